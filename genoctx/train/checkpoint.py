"""Checkpoints: weights in safetensors, optimizer and data-order state beside them, written atomically.

Layout of a run directory::

    RUN/
      metrics.jsonl                 one JSON object per logged step
      checkpoints/
        step_000100/
          model.safetensors         weights and buffers (MoE router biases included)
          optimizer.pt              AdamW and LR-schedule state
          state.json                step, data-order state, tokens seen, genoctx version, and the size and
                                    xxh3_64 digest of every other file ("files"); written last
          recipe.yaml               the resolved recipe that produced it

A distributed run (world > 1) writes ``dcp/`` (torch.distributed.checkpoint shards) and ``scheduler.json`` instead
of ``model.safetensors`` and ``optimizer.pt`` (``genoctx.train.sharded``); every reader here takes both.

A checkpoint directory is first written under a temporary name (``checkpoints/.step_000100.XXXX``) and renamed
into place when complete, so a killed run never leaves a half-written checkpoint that ``latest_checkpoint`` would
pick; ``remove_partial_checkpoints`` deletes such abandoned temporaries when the next run starts.

Every file a save writes is read back and its size and xxh3_64 digest recorded in state.json (``file_digest``);
readers check them before loading (``genoctx.train.integrity``). ``keep`` pruning (``prune_checkpoints``) counts
only the checkpoints up to the one just written: a newer one left by an earlier attempt (one a resume skipped as
damaged) is never one of the kept N.

A run from a base (``--init``) that trains a subset (``train.trainable`` not ``all``: named groups, LoRA adapters)
writes partial checkpoints (state.json ``"holds": "trainable"``): ``model.safetensors`` holds only what trains
(``held_names``: the trained groups' parameters, the adapters, and the persistent buffers of trained groups, e.g. the
MoE routing biases when the router trains) and ``optimizer.pt`` its AdamW state; the frozen base is not copied but
named by state.json's ``init`` record (path, kind, sha256 of its config and of state.json for a genoctx base, and
``weights``: the size and xxh3_64 of every weight file of an HF base, hashed once when the run starts). Every reader
builds the model from that base, checks the base is the one recorded (``base_problem``; a changed or missing base
is a one-line ``GenoctxError``), then overlays the checkpoint's tensors strictly (``load_model_tensors(held=...)``).

Tied embeddings (``model.tie_word_embeddings``) are stored once, as ``embed_tokens.weight``, with no
``lm_head.weight`` (transformers' convention for tied weights); loading ties them again.

Checkpoints are data, not code: ``optimizer.pt`` is read with ``torch.load(weights_only=True)``, so a file whose
unpickling would run code is refused. Every unreadable file (corrupt or truncated safetensors, optimizer state or
state.json) is a ``GenoctxError`` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .. import __version__
from ..errors import GenoctxError
from ..lock import share_like_umask
from ..model.hf import is_hf_dir
from ..model.model import HybridLM
from ..parallel.state import DCP_DIR, TIED_HEAD, is_sharded
from ..recipes import Recipe, recipe_from_dict

CKPT_DIR = "checkpoints"
ALGO = "xxh3_64"  # the digest recorded for each file
FILES_KEY = "files"  # state.json's key of the digests: {name: {"bytes": n, "xxh3_64": hex}}
BLOCK = 8 << 20  # bytes read per call while hashing
_STEP_DIR = re.compile(r"^step_(\d+)$")

log = logging.getLogger("genoctx.train")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(ckpt: Path) -> int | None:
    """The step of a checkpoint directory named ``step_N``; None for another name."""
    m = _STEP_DIR.match(Path(ckpt).name)
    return int(m.group(1)) if m else None


def file_digest(path: Path) -> dict:
    """``{"bytes": n, "xxh3_64": 16 hex digits}`` of the file at ``path``, streamed through the hash in blocks of
    ``BLOCK`` bytes of a read-only memory map (no copy out of the page cache: ~1.4x faster than ``readinto`` here).

    Raises:
        OSError: the file cannot be read.
    """
    import mmap

    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        n = os.fstat(f.fileno()).st_size
        if n == 0:
            return {"bytes": 0, ALGO: h.hexdigest()}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(m)
            try:
                for i in range(0, n, BLOCK):
                    h.update(view[i : i + BLOCK])
            finally:
                view.release()
    return {"bytes": n, ALGO: h.hexdigest()}


def digest_files(root: Path, names) -> dict[str, dict]:
    """``file_digest`` of each of ``names`` (paths relative to ``root``, ``/``-separated), by name."""
    return {name: file_digest(Path(root) / name) for name in names}


def prune_checkpoints(run_dir: Path, step: int, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest checkpoints of steps <= ``step`` (the one just written and its
    predecessors); newer ones, left by an attempt before a resume fell back, are neither counted nor removed (they
    are overwritten when the run reaches their step). ``keep`` 0 removes nothing. Returns what was removed."""
    if keep <= 0:
        return []
    done = [c for c in list_checkpoints(run_dir) if step_of(c) <= step]
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return done[:-keep]


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: HybridLM,
    optimizer,
    scheduler,
    recipe: Recipe,
    state: dict,
    keep: int = 0,
) -> Path:
    """Write a checkpoint of ``step`` under ``run_dir/checkpoints`` atomically; returns its directory.

    Every file is read back after writing and its size and xxh3_64 digest go into state.json (``"files"``), written
    last. ``keep`` > 0 removes all but the ``keep`` most recent complete checkpoints afterwards
    (``prune_checkpoints``). The fault injection of
    ``genoctx.train.faults`` (``GENOCTX_FAULT_KILL=save:STEP``) fires after the files are written, before the
    rename: what a kill during a save leaves behind.
    """
    from .faults import maybe_kill

    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        tensors = model_tensors(model)
        if is_partial(state):  # a run from a base training a subset: only what trains (module docstring)
            held = held_names(model, recipe.train.trainable)
            tensors = {k: v for k, v in tensors.items() if k in held}
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"genoctx_version": __version__})
        torch.save(
            {
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            },
            tmp / "optimizer.pt",
        )
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        files = digest_files(tmp, ("model.safetensors", "optimizer.pt", "recipe.yaml"))  # as on disk
        doc = {"step": step, "genoctx_version": __version__, **state, FILES_KEY: files}
        (tmp / "state.json").write_text(json.dumps(doc, indent=1))
        maybe_kill("save", 0, step, Path(run_dir))
        share_like_umask(tmp)  # mkdtemp made it 0700: readable by collaborators, as a plain mkdir would be
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(run_dir, step, keep)
    return final


def model_tensors(model: HybridLM) -> dict[str, torch.Tensor]:
    """The state dict to store: every parameter and persistent buffer, ``lm_head.weight`` left out when it is the
    embedding itself (tied), as transformers stores tied weights (safetensors refuses two names for one memory)."""
    sd = model.state_dict()
    if model.lm_head.weight is model.embed_tokens.weight:
        sd.pop(TIED_HEAD, None)
    return sd


HOLDS, TRAINABLE = "holds", "trainable"  # state.json "holds": "trainable" marks a partial checkpoint


def is_partial(state: dict) -> bool:
    """Whether a checkpoint (its state.json dict) holds only what trains and names its base (module docstring)."""
    return state.get(HOLDS) == TRAINABLE


def held_names(model: HybridLM, spec: str) -> set[str]:
    """What a partial checkpoint of ``model`` trained with ``train.trainable`` ``spec`` stores: every parameter
    whose group (``genoctx.model.groups.group_of``; adapters: ``lora``) ``spec`` names, and every persistent buffer
    whose group it names (the MoE routing bias ``mlp.gate.e_score_correction_bias`` moves with the router and stays
    with it frozen) or that no group holds (kept: when unsure, store it); never an fp8 holder of a frozen weight
    (``genoctx.model.fp8.FP8Weight``: part of the base). Keyed on the spec, not on ``requires_grad``, so that a
    stage freezing more for a while (the indexer warm-up) stores the same names. A tied ``lm_head.weight`` is left
    out as ``model_tensors`` leaves it out.

    Raises:
        GenoctxError: a bad ``spec`` (named).
    """
    from ..model.fp8 import FP8Weight
    from ..model.groups import LORA, group_of, parse_trainable
    from ..model.lora import is_lora_name

    try:
        groups = set(parse_trainable(spec))
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8Weight)}
    params = {n for n, _ in model.named_parameters()}
    out = set()
    for name in model_tensors(model):
        if name.rpartition(".")[0] in fp8:
            continue
        if is_lora_name(name):
            group = LORA
        else:
            try:
                group = group_of(name, model.cfg.layer_types)
            except ValueError:  # a tensor no group holds (a buffer): kept
                group = None
        if group in groups or (group is None and name not in params):
            out.add(name)
    return out


def base_weights(path: Path) -> dict[str, dict]:
    """The content digest of an HF base: ``{file name: {"bytes", "xxh3_64"}}`` of each of its weight files
    (``genoctx.model.hf.weight_files``; ``file_digest``). A safetensors header's hash does not change when a value
    does; this does. Hashed once when a partial run starts (xxh3_64 at memory speed: GLM-5.3-Flash's ~313 GB of fp8
    weights in ~2 minutes at the 3 GB/s of ``bench/verify.py``, an estimate) and again by every reader of its
    checkpoints (``base_problem``).

    Raises:
        GenoctxError: no weights or an unreadable index (``weight_files``); OSError: a file cannot be read.
    """
    from ..model.hf import weight_files

    return {f.name: file_digest(f) for f in weight_files(path)}


def base_problem(state: dict, ckpt: Path) -> str | None:
    """The one-line problem of a partial checkpoint's base (``is_partial``), or None when it is the base recorded
    (a full checkpoint: None, it needs no base). State.json's ``init`` names the base:

    - an HF directory (``kind`` ``hf``): its weight files' sizes and xxh3_64 (``weights``, ``base_weights``) and
      the sha256 of its config.json (``files``) recomputed and compared;
    - a genoctx checkpoint (``kind`` ``genoctx``, a ``--init RUN``): the sha256 of its state.json (``files``), and
      its weights and recipe against the digests that state.json records; a partial one's own base in turn.

    Args:
        state: the checkpoint's state.json dict; ckpt: its directory (named in the line).
    """
    import hashlib

    if not is_partial(state):
        return None
    init = state.get("init") if isinstance(state.get("init"), dict) else {}
    path = Path(str(init.get("path")))
    head = f"{ckpt}: its base {path}"
    if not init.get("path") or not path.is_dir():
        return f"{head} is missing (the checkpoint holds only what trains: restore the base at that path)"
    files = init.get("files") or {}
    kind = init.get("kind")
    small = ["config.json"] if kind == "hf" else ["state.json"]
    for name in small:
        want = files.get(name)
        f = path / name
        if want is None:
            continue
        got = hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None
        if got != want:
            return f"{head} changed since the run started: {name} sha256 {got} on disk, {want} recorded in state.json"
    if kind == "hf":
        want = init.get("weights")
        if not isinstance(want, dict) or not want:
            return f"{head}: no weight digests recorded in state.json (init.weights): cannot tell it is unchanged"
        try:
            got = base_weights(path)
        except (GenoctxError, OSError) as e:
            return f"{head} is unreadable ({_first_line(e)})"
        for name in sorted(set(want) | set(got)):
            w, g = want.get(name), got.get(name)
            if w != g:
                what = (f"{ALGO} {g[ALGO]} ({g['bytes']} bytes) on disk, {w[ALGO]} ({w['bytes']} bytes) recorded"
                        if w and g else "not on disk" if w else "not recorded")  # fmt: skip
                return f"{head} changed since the run started: {name} {what} in {ckpt / 'state.json'}"
        return None
    try:  # a genoctx checkpoint: its recorded digests (pinned by the sha256 of its state.json above)
        base_state = read_state(path)
    except GenoctxError as e:
        return f"{head} is unreadable ({e})"
    recorded = base_state.get(FILES_KEY) or {}
    for name in sorted(n for n in recorded if n not in ("optimizer.pt", "scheduler.json")):
        f = path / name
        got = file_digest(f) if f.is_file() else None
        if got is None or got.get(ALGO) != recorded[name].get(ALGO) or got["bytes"] != recorded[name].get("bytes"):
            return f"{head} changed since the run started: {name} differs from the digest its state.json records"
    return base_problem(base_state, path)


def check_base(state: dict, ckpt: Path) -> None:
    """Refuse to load a partial checkpoint whose base changed or is missing (``base_problem``).

    Raises:
        GenoctxError: one line naming the checkpoint, the base path and what differs.
    """
    bad = base_problem(state, ckpt)
    if bad is not None:
        raise GenoctxError(bad)


def partial_record(trainable: str, base: dict | None, resumed: dict | None = None,
                   ckpt: Path | None = None) -> dict | None:  # fmt: skip
    """The base record (state.json ``init``) of a run whose checkpoints hold only what trains, or None when they
    hold everything: a run from scratch (no base to name), or ``train.trainable: all``.

    Args:
        trainable: ``train.trainable``; base: the run's base record (``genoctx.train.init.resolve_init``) or None.
        resumed, ckpt: a resume's checkpoint state.json and directory (None for a new run): a partial one's
            recorded base is checked (``check_base``) and returned as recorded; a whole one's: None.

    For a new run from an HF base, its weight files are hashed once here (``base_weights``, into ``base``); a
    genoctx checkpoint (``--init RUN``) is pinned by its own state.json's digests, and its base is checked in turn
    when it is partial (``check_base_chain``, for any ``trainable``).

    Raises:
        GenoctxError: a changed or missing base (``check_base``).
    """
    if resumed is not None:
        if not is_partial(resumed):
            return None
        check_base(resumed, Path(ckpt))
        return resumed["init"]
    check_base_chain(base)
    if base is None or trainable == "all":
        return None
    if base.get("kind") != "genoctx":
        base["weights"] = base_weights(Path(base["path"]))
    return base


def check_base_chain(base: dict | None) -> None:
    """For a run starting from a genoctx checkpoint (``--init RUN``, ``base`` its record): when that checkpoint is
    partial, its own base must be the one it recorded (``check_base``); nothing for another base or None.

    Raises:
        GenoctxError: a changed or missing base of the base (one line naming both).
    """
    if base is not None and base.get("kind") == "genoctx":
        path = Path(base["path"])
        check_base(read_state(path), path)


def base_of(state: dict):
    """Where a partial checkpoint's base is read from (``genoctx.parallel.build``'s ``FromHF`` or
    ``FromCheckpoint``, which follows a partial base's own base), from its state.json ``init``."""
    from ..parallel.build import FromCheckpoint, FromHF

    init = state["init"]
    return FromCheckpoint(Path(init["path"])) if init.get("kind") == "genoctx" else FromHF(Path(init["path"]))


def load_model_tensors(model: HybridLM, tensors: dict[str, torch.Tensor], source: Path,
                       held: set[str] | None = None) -> None:  # fmt: skip
    """Load ``tensors`` (as ``model_tensors`` wrote them) into ``model`` strictly; a tied model gets its head from
    the embedding (and stays tied).

    Args:
        held: for a partial checkpoint (``is_partial``), the names it must hold (``held_names``): exactly those are
            loaded and every other tensor keeps the value the base filled in. None: every tensor of the model.

    Raises:
        GenoctxError: missing, unexpected or misshapen tensors, named with ``source``.
    """
    tied = model.lm_head.weight is model.embed_tokens.weight
    if tied and TIED_HEAD not in tensors and "embed_tokens.weight" in tensors:
        tensors = {**tensors, TIED_HEAD: tensors["embed_tokens.weight"]}
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a shape that differs
        raise GenoctxError(f"{source} does not match its recipe's model ({_first_line(e)})") from None
    if held is not None:
        missing = sorted(held - set(tensors) - ({TIED_HEAD} if tied else set()))
    if missing or unexpected:
        raise GenoctxError(
            f"{source} does not match its recipe's model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def read_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file.

    Raises:
        GenoctxError: the file is missing, truncated or not safetensors (the file is named).
    """
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise GenoctxError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None


def read_state(ckpt: Path) -> dict:
    """``ckpt/state.json`` as a dict with an integer ``step``.

    Raises:
        GenoctxError: missing (``no_state_line``), not JSON, or without a whole ``step`` >= 0 (the file is named).
    """
    path = Path(ckpt) / "state.json"
    if Path(ckpt).is_dir() and not path.exists():
        raise GenoctxError(no_state_line(Path(ckpt)))
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GenoctxError(f"{path}: not a readable checkpoint state ({_first_line(e)})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise GenoctxError(f"{path}: 'step' must be a whole number >= 0, got {step!r}")
    return state


def read_optimizer(path: Path, mmap: bool = False) -> dict:
    """The optimizer and schedule state of ``optimizer.pt``, read as data (``torch.load(weights_only=True)``).

    Args:
        path: the file; ``mmap``: map its tensors from the file instead of reading them (a rank copies only the
            slices it holds).

    Returns:
        ``{"optimizer": state dict or None, "scheduler": state dict or None}``.

    Raises:
        GenoctxError: a file that needs pickle code execution to load (refused, never run), or one that is missing,
            truncated or corrupt.
    """
    import pickle

    try:
        opt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise GenoctxError(
                f"{path}: refused: loading it would execute pickled code (genoctx reads checkpoints as data only, "
                "torch.load(weights_only=True))"
            ) from None
        raise GenoctxError(f"{path}: not a readable optimizer state ({_first_line(e)})") from None
    except Exception as e:  # noqa: BLE001 -- unpickling corrupt bytes raises anything (IndexError, KeyError, ...)
        raise GenoctxError(f"{path}: not a readable optimizer state, truncated or corrupt ({_first_line(e)})") from None
    if not isinstance(opt, dict) or not {"optimizer", "scheduler"} <= set(opt):
        raise GenoctxError(f"{path}: not a genoctx optimizer state (expected keys 'optimizer' and 'scheduler')")
    return opt


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def validate_checkpoint(ckpt: Path) -> dict:
    """Check that a checkpoint can be resumed from without loading its tensors: state.json, the safetensors
    header, the optimizer state (read as data). Returns its state.json dict.

    Raises:
        GenoctxError: any of the files unreadable (named).
    """
    from safetensors import safe_open

    state = read_state(ckpt)
    if is_sharded(ckpt):  # a distributed run's DCP checkpoint (genoctx.train.sharded)
        checkpoint_keys(ckpt)
        _load_scheduler(ckpt, None)
        return state
    path = Path(ckpt) / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise GenoctxError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
    read_optimizer(Path(ckpt) / "optimizer.pt")
    return state


def restore_schedule(scheduler, state: dict | None) -> None:
    """Restore the learning-rate schedule of a resumed run: the step count (``last_epoch``) from ``state``, and every
    optimizer param group's ``lr`` set to the rate of THIS invocation's schedule at that step.

    The schedule is a function of (step, this recipe's ``train.steps``, ``lr``, ``warmup_steps``, ``min_lr_ratio``):
    ``scheduler``'s own ``base_lrs`` and ``lr_lambdas`` (``build_optimizer``'s, from the resumed recipe) are kept and
    only the step is taken from the checkpoint, so the first resumed step lies on the schedule the run now follows.
    With an unchanged recipe that is the uninterrupted run's rate; with another ``--steps`` (or lr) it is the rate an
    uninterrupted run of the new recipe has at that step (``genoctx.train.loop.check_resume`` logs it). Loading
    ``state`` whole would keep the old ``base_lrs`` and ``_last_lr`` (the old schedule's rate for the first resumed
    step, the new one's after: a rate on neither). A DCP checkpoint holds only the optimizer's tensors, so the
    optimizer's ``lr`` must be set here in any case. Every load path calls this (``load_training_state``,
    ``load_full_optimizer``, ``genoctx.train.sharded.load_sharded`` and ``load_any``).

    Args:
        scheduler: ``build_optimizer``'s ``LambdaLR`` (another ``torch.optim.lr_scheduler``: its state loaded whole
            and ``get_last_lr()`` set), or None (nothing done).
        state: its ``state_dict()`` as saved, or None (a checkpoint saved without one: nothing done).
    """
    if scheduler is None or state is None:
        return
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        scheduler.load_state_dict(state)
        lrs = scheduler.get_last_lr()
    else:
        base = list(scheduler.base_lrs)  # this recipe's train.lr (load_state_dict would put the saved ones back)
        scheduler.load_state_dict(state)
        scheduler.base_lrs = base
        lrs = [b * f(scheduler.last_epoch) for b, f in zip(base, lambdas, strict=True)]
        scheduler._last_lr = list(lrs)
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    if lambdas is not None:
        for group, b in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["initial_lr"] = b


# DCP checkpoints of a distributed run (written by genoctx.train.sharded), read here in one process
def _load_scheduler(ckpt: Path, scheduler) -> None:
    path = Path(ckpt) / "scheduler.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GenoctxError(f"{path}: not readable JSON ({_first_line(e)})") from None
    restore_schedule(scheduler, doc)


def checkpoint_keys(ckpt: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Tensor names of a DCP checkpoint with their global shapes and dtypes, read from ``dcp/.metadata`` only.

    Raises:
        GenoctxError: no readable metadata (named).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(ckpt) / DCP_DIR
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise GenoctxError(f"{path}/.metadata: not a readable DCP checkpoint ({_first_line(e)})") from None
    return {
        k: (v.size, v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def read_full_tensors(ckpt: Path, prefix: str = "model.", names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors of a DCP checkpoint in one process (no process group), the ``prefix`` removed from the names.

    ``names`` (without the prefix) limits what is read: ``genoctx export`` reads one output shard at a time, so the
    whole model is never in memory at once.

    Raises:
        GenoctxError: unreadable files or unknown names (named).
    """
    import torch.distributed.checkpoint as dcp

    keys = checkpoint_keys(ckpt)
    wanted = [k for k in keys if k.startswith(prefix)] if names is None else [prefix + n for n in names]
    missing = [k for k in wanted if k not in keys]
    if missing:
        raise GenoctxError(f"{ckpt}/{DCP_DIR}: has no tensor {missing[0]!r}")
    sd = {k: torch.empty(keys[k][0], dtype=keys[k][1]) for k in wanted}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized": intended here
            dcp.load(sd, checkpoint_id=str(Path(ckpt) / DCP_DIR), no_dist=True)
    except Exception as e:
        raise GenoctxError(f"{ckpt}/{DCP_DIR}: unreadable ({_first_line(e)})") from None
    return {k[len(prefix) :]: v for k, v in sd.items()}


def load_full_optimizer(ckpt: Path, model, optimizer, scheduler) -> None:
    """Restore a one-process model's AdamW state and schedule from a DCP checkpoint (any layout it was saved in)."""
    from ..parallel.state import canonical_state

    sd = canonical_state(model, optimizer, None)
    want = {k: v for k, v in sd.items() if k.startswith("optim.")}
    got = read_full_tensors(ckpt, prefix="", names=list(want))
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(got[k])
    _load_scheduler(ckpt, scheduler)


def remove_partial_checkpoints(run_dir: Path) -> list[str]:
    """Delete the temporaries (``checkpoints/.step_*``) a killed save left behind; returns their names.

    Only the run's single writer may call this (``genoctx.lock.output_lock`` on the run directory): a live save
    of another process would lose its files.
    """
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    gone = sorted(p.name for p in root.iterdir() if p.name.startswith(".step_"))
    for name in gone:
        p = root / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return gone


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (``checkpoints/step_N`` with a state.json), oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and (p / "state.json").is_file()]
    return sorted(found, key=step_of)


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders of a run without a state.json (``checkpoints/step_N/``), oldest first: not checkpoints
    genoctx reads. A save writes state.json last and renames its folder into place only then, so such a folder is an
    interrupted copy (or a state.json removed by hand); ``list_checkpoints`` never lists it."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir() and not (p / "state.json").is_file()]
    return sorted(found, key=step_of)


def newer_incomplete(run_dir: Path, chosen: Path | None) -> list[Path]:
    """The ``incomplete_checkpoints`` of ``run_dir`` of a later step than the checkpoint ``chosen`` (all of them
    when ``chosen`` is None or not named ``step_N``), oldest first: what a reader of the run's newest checkpoint
    would have read, had it been complete."""
    after = step_of(chosen) if chosen is not None else None
    return [p for p in incomplete_checkpoints(run_dir) if after is None or step_of(p) > after]


def incomplete_line(path: Path) -> str:
    """The one-line description of an incomplete checkpoint folder (``incomplete_checkpoints``)."""
    return f"{path} is incomplete (no state.json, which a save writes last: an interrupted copy?)"


def no_state_line(ckpt: Path) -> str:
    """The one-line description of a checkpoint folder without state.json, as every reader names it."""
    return f"{ckpt} has no state.json: not a genoctx checkpoint (an incomplete save?)"


def looks_like_checkpoint(p: Path) -> bool:
    """Whether directory ``p`` without a state.json is a checkpoint folder that lacks it: named ``step_N``, or holding
    what a save writes (``model.safetensors``, ``optimizer.pt``, ``recipe.yaml``, ``dcp/``), and not a run (no
    ``checkpoints/``) nor an HF model directory."""
    if not p.is_dir() or (p / "state.json").is_file() or (p / CKPT_DIR).is_dir() or is_hf_dir(p):
        return False
    return step_of(p) is not None or any((p / n).exists() for n in ("model.safetensors", "optimizer.pt",
                                                                    "recipe.yaml", "dcp"))  # fmt: skip


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The most recent complete checkpoint of a run, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, a run directory meaning its latest checkpoint, or an HF model directory
    (``config.json`` + safetensors, ``genoctx.model.hf.is_hf_dir``), returned as is.

    A run's incomplete checkpoint folders (``incomplete_checkpoints``: no state.json) are never read: older than its
    latest complete one, they are named in one warning; newer, the run is refused (a reader of a run's newest
    checkpoint never reads an older one silently, as ``genoctx.train.integrity.refuse_unverified`` refuses a newest
    one that does not verify).

    Raises:
        GenoctxError: the path is none of these, a checkpoint folder without state.json or without weights (named as
            such), the run has no complete checkpoint, or a newer incomplete one (named with the newest complete one,
            to pass explicitly).
    """
    p = Path(path)
    weights = (p / "model.safetensors").is_file() or (p / "dcp" / ".metadata").is_file()
    if (p / "state.json").is_file() and weights:
        return p
    if is_hf_dir(p):
        return p
    if (p / "state.json").is_file():
        raise GenoctxError(f"{p} has state.json but no model.safetensors or dcp/.metadata: an incomplete checkpoint")
    if looks_like_checkpoint(p):
        raise GenoctxError(no_state_line(p))
    if p.is_dir():
        latest = latest_checkpoint(p)
        newer = newer_incomplete(p, latest)
        if newer:
            tail = (f"the newest complete checkpoint is {latest}: pass it explicitly to read it" if latest is not None
                    else f"{p} has no complete checkpoint")  # fmt: skip
            raise GenoctxError(f"{p}: its newest checkpoint {incomplete_line(newer[-1])}; {tail}")
        if latest is not None:
            older = incomplete_checkpoints(p)
            if older:
                log.warning("%s: reading %s; not read: %s", p, latest.name, "; ".join(map(incomplete_line, older)))
            return latest
        raise GenoctxError(
            f"no checkpoint in {p} (expected {p}/{CKPT_DIR}/step_*/, a checkpoint directory with state.json or an HF "
            "model directory with config.json and model.safetensors)"
        )
    raise GenoctxError(f"checkpoint not found: {p}")


def load_recipe_of(ckpt: Path) -> Recipe:
    """The resolved recipe saved beside a checkpoint.

    Raises:
        GenoctxError: recipe.yaml missing, not YAML, or not a valid recipe (the file is named).
    """
    path = Path(ckpt) / "recipe.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise GenoctxError(f"{path}: not a readable recipe ({_first_line(e)})") from None
    return recipe_from_dict(raw, str(path))


def load_model(ckpt: str | Path, device: str | torch.device = "cpu") -> tuple[HybridLM, Recipe, dict]:
    """Load (model, recipe, state) from a genoctx checkpoint or run directory (an HF model directory is read
    with ``genoctx.model.load_hf`` instead: it has no recipe or training state). The model is whole (a LoRA run's
    with its adapters); a partial checkpoint's (``is_partial``) is built from its recorded base, checked first
    (``check_base``), with the checkpoint's tensors over it.

    Raises:
        GenoctxError: missing or unreadable checkpoint files, an HF model directory, or a partial checkpoint whose
            base changed or is missing (one line naming both).
    """
    ckpt = resolve_checkpoint(ckpt)
    if not (ckpt / "state.json").is_file():
        raise GenoctxError(f"{ckpt} is an HF model directory, not a genoctx checkpoint (use genoctx.model.load_hf)")
    from ..parallel.build import FromCheckpoint, build_model
    from .frozen import frozen_fp8

    recipe = load_recipe_of(ckpt)
    state = read_state(ckpt)
    fp8 = frozen_fp8(recipe.train, recipe.model, state=state)  # train.frozen_dtype fp8: the holders it stores
    if is_partial(state):  # only what trains: the base the run started from, checked, then the checkpoint over it
        check_base(state, ckpt)
        model = build_model(recipe.model, None, source=base_of(state), device=device, frozen_fp8=fp8)
        if has_lora(recipe):
            apply_recipe_lora(model, recipe)
        tensors = read_full_tensors(ckpt) if is_sharded(ckpt) else read_tensors(ckpt / "model.safetensors", device)
        load_model_tensors(model, tensors, ckpt, held=held_names(model, recipe.train.trainable))
        return model, recipe, state
    if has_lora(recipe):  # a LoRA run's checkpoint holds the adapters: rebuild them (train.lora_*), then load all
        from ..parallel.build import Zeros

        model = build_model(recipe.model, None, source=Zeros(), device=device, frozen_fp8=fp8)
        apply_recipe_lora(model, recipe)
        tensors = read_full_tensors(ckpt) if is_sharded(ckpt) else read_tensors(ckpt / "model.safetensors", device)
        load_model_tensors(model, tensors, ckpt)
        return model, recipe, state
    # the one construction path on the mesh of size 1: allocated once, every tensor read (DCP in any layout it was
    # saved in, or model.safetensors), nothing drawn first
    model = build_model(recipe.model, None, source=FromCheckpoint(ckpt), device=device, frozen_fp8=fp8)
    return model, recipe, state


def has_lora(recipe: Recipe) -> bool:
    """Whether ``recipe.train.trainable`` names ``lora`` (its checkpoints then hold the adapters)."""
    from ..model.groups import LORA, parse_trainable

    return LORA in parse_trainable(recipe.train.trainable)


def apply_recipe_lora(model: HybridLM, recipe: Recipe) -> list[str]:
    """Add the LoRA adapters of ``recipe.train`` (``lora_rank``, ``lora_alpha``, ``lora_targets``) to ``model`` in
    place (``genoctx.model.lora.apply_lora``), A drawn from a generator seeded with ``train.seed`` (B zero: the
    model's output is unchanged). Returns the adapted names.

    Raises:
        GenoctxError: one line naming ``train.lora_targets`` / ``train.lora_rank`` (a target matching nothing, a
            tied ``lm_head``, a model that already has adapters).
    """
    from ..model.lora import apply_lora

    t = recipe.train
    try:
        return apply_lora(model, t.lora_rank, t.lora_alpha, t.lora_targets, seed=t.seed)
    except ValueError as e:
        raise GenoctxError(f"train.lora_targets {t.lora_targets!r}: {e}") from None


def load_training_state(ckpt: Path, model: HybridLM, optimizer, scheduler) -> dict:
    """Restore model, optimizer and schedule in place from ``ckpt``; returns its state.json dict. For a partial
    checkpoint (``is_partial``) ``model`` must have been built from its base (``base_of``): the base is checked
    (``check_base``) and only what trains is loaded over it.

    Raises:
        GenoctxError: an unreadable or mismatching file (named), or an optimizer state that needs code to load.
    """
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    held = None
    if is_partial(state):  # the model holds its base already (built from base_of(state)): what trains over it
        check_base(state, ckpt)
        held = held_names(model, load_recipe_of(ckpt).train.trainable)
    if is_sharded(ckpt):  # saved by a distributed run in any layout: whole tensors in this one process
        load_model_tensors(model, read_full_tensors(ckpt), ckpt / "dcp", held=held)
        load_full_optimizer(ckpt, model, optimizer, scheduler)
        return state
    opt = read_optimizer(ckpt / "optimizer.pt")
    load_model_tensors(model, read_tensors(ckpt / "model.safetensors"), ckpt / "model.safetensors", held=held)
    try:
        if optimizer is not None and opt["optimizer"] is not None:
            optimizer.load_state_dict(opt["optimizer"])
        restore_schedule(scheduler, opt["scheduler"])
    except (KeyError, TypeError, ValueError) as e:
        raise GenoctxError(f"{ckpt / 'optimizer.pt'}: does not fit this model's optimizer ({_first_line(e)})") from None
    return state
