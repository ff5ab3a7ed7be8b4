"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) of a model laid out on the 4-D mesh, reshardable.

A distributed run (world > 1) writes::

    checkpoints/step_000100/
      dcp/                   DCP: one ``__R_0.distcp`` per rank (its shards), ``.metadata`` written last by DCP
      scheduler.json         the LR schedule's state (small, rank 0)
      recipe.yaml            the resolved recipe (rank 0)
      state.json             step, data order, layout, ``"format": "dcp"``, the size and xxh3_64 digest of every
                             other file (``"files"``): written last (the commit marker)

Every rank writes into the same temporary folder (``checkpoints/.step_000100.XXXX``, named by rank 0) and then reads
back and hashes its own shard files (``__R_*.distcp``: the hashing is spread as the writing is); the digests are
gathered to rank 0, which hashes ``.metadata``, ``scheduler.json`` and ``recipe.yaml``, writes ``state.json`` and
renames the folder into place, so a killed save leaves a temporary that ``remove_partial_checkpoints`` deletes and
``latest_checkpoint`` never picks.

The state dict is in canonical, layout-free form: the keys are the one-device names (``model_tensors``) and
``optim.<name>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` (AdamW), each tensor with its global shape. A rank offers what
it holds: an FSDP shard (a DTensor), a replicated tensor (DCP writes one copy), or its block of routed experts under
expert parallelism, presented as a DTensor ``Shard(0)`` over ``ep`` (and FSDP's ``Shard(0)`` over ``dp_shard x cp``
inside it) of the ``[n_routed_experts, ...]`` tensor. DCP stores chunks with their global offsets, so a checkpoint
saved in one layout loads in any other (FSDP=2 x EP=2 -> FSDP=2, EP=2 -> one process, ...): each rank reads the
pieces it now holds (``load_sharded``). ``read_full_tensors`` (``genoctx.train.checkpoint``, which reads every
checkpoint in one process) reads one without any process group, whole tensors (one process: eval, resume at world
1) or a few names at a time (``genoctx export``: one output shard at a time, never the whole model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from .. import __version__
from ..errors import GenoctxError
from ..lock import share_like_umask
from ..parallel import collectives as coll
from ..parallel.state import canonical_state
from ..recipes import Recipe
from .checkpoint import (
    CKPT_DIR,
    DCP_DIR,
    FILES_KEY,
    TIED_HEAD,
    _load_scheduler,
    checkpoint_keys,
    checkpoint_name,
    digest_files,
    is_sharded,
    prune_checkpoints,
    read_full_tensors,
    read_optimizer,
    restore_schedule,
)

FORMAT = "dcp"


def save_sharded(
    run_dir: Path, step: int, model, optimizer, scheduler, recipe: Recipe, state: dict, dims, keep: int = 0,
    held: set[str] | None = None,
) -> Path:  # fmt: skip
    """Write ``RUN/checkpoints/step_{step}`` from every rank of ``dims`` (a collective: all ranks call it).

    Returns the final directory (on every rank). Each rank reads back and hashes the shard files it wrote; rank 0
    records every file's size and xxh3_64 digest in state.json (module docstring). ``keep`` > 0 removes all but the
    ``keep`` newest checkpoints up to this one (rank 0, ``prune_checkpoints``). ``held``: a partial checkpoint (a run
    from a base training a subset; ``state`` holds ``"holds": "trainable"`` and the base's ``init``): only these model
    tensors (``genoctx.train.checkpoint.held_names``) and the optimizer state (which holds only what trains). The
    fault injection ``GENOCTX_FAULT_KILL=save:STEP`` fires on rank 0 after the shards are written, before
    ``state.json`` and the rename.
    """
    import torch.distributed.checkpoint as dcp

    from .faults import maybe_kill

    rank = dist.get_rank()
    root = Path(run_dir) / CKPT_DIR
    final = root / checkpoint_name(step)
    name = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        name = [tempfile.mkdtemp(prefix=f".{final.name}.", dir=root)]
    coll.broadcast_object_list(name, src=0)
    tmp = Path(name[0])
    try:
        dcp.save(_held_state(canonical_state(model, optimizer, dims), held), checkpoint_id=str(tmp / DCP_DIR))
        mine = digest_files(tmp, _rank_shards(tmp, rank))  # this rank's files, read back from disk
        parts = [None] * dist.get_world_size()
        coll.all_gather_object(parts, mine)  # (also the barrier: every rank's files are complete)
        if rank == 0:
            (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict() if scheduler is not None else None))
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
            maybe_kill("save", 0, step, Path(run_dir))
            files = {k: v for p in parts for k, v in p.items()}
            rest = [f"{DCP_DIR}/{p.name}" for p in sorted((tmp / DCP_DIR).iterdir()) if p.is_file()]
            files.update(digest_files(tmp, [n for n in rest if n not in files] + ["scheduler.json", "recipe.yaml"]))
            layout = dims.layout.to_dict() if dims is not None else None
            doc = {"step": step, "genoctx_version": __version__, "format": FORMAT, "layout": layout, **state,
                   FILES_KEY: dict(sorted(files.items()))}  # fmt: skip
            (tmp / "state.json").write_text(json.dumps(doc, indent=1))
            share_like_umask(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            prune_checkpoints(run_dir, step, keep)
        coll.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _held_state(sd: dict, held: set[str] | None) -> dict:
    """``canonical_state`` less the model tensors a partial checkpoint does not hold (``held`` None: all of it)."""
    return sd if held is None else {k: v for k, v in sd.items() if not k.startswith("model.") or k[6:] in held}


def _rank_shards(root: Path, rank: int) -> list[str]:
    """The DCP shard files rank ``rank`` wrote under ``root/dcp`` (``__{rank}_{i}.distcp``, the names torch's
    ``FileSystemWriter`` gives them), relative to ``root``. Any other file of ``dcp/`` (``.metadata``) rank 0
    hashes."""
    return sorted(f"{DCP_DIR}/{p.name}" for p in (Path(root) / DCP_DIR).glob(f"__{rank}_*.distcp"))


def load_sharded(ckpt: Path, model, optimizer, scheduler, dims, held: set[str] | None = None) -> None:
    """Restore model, optimizer and schedule in place from a DCP checkpoint saved in any layout (a collective).
    ``held``: a partial checkpoint's names (``save_sharded``): it must hold exactly these model tensors, loaded over
    the base the model was built from; every other tensor keeps its value.

    Raises:
        GenoctxError: the checkpoint does not hold this model's tensors (named), or its files are unreadable.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..parallel.build import dcp_error_line

    sd = _held_state(canonical_state(model, optimizer, dims), held)
    if held is not None:
        keys = {k[6:] for k in checkpoint_keys(ckpt) if k.startswith("model.")}
        if keys != held:
            odd = sorted(keys - held) or sorted(held - keys)
            raise GenoctxError(f"{ckpt}/{DCP_DIR}: holds only what trains, but not this run's: "
                               f"{'unexpected' if keys - held else 'missing'} {odd[0]}")  # fmt: skip
    try:
        dcp.load(sd, checkpoint_id=str(Path(ckpt) / DCP_DIR))
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps every rank's
        raise GenoctxError(f"{ckpt}/{DCP_DIR}: cannot load it into this model ({dcp_error_line(e)})") from None
    _load_scheduler(ckpt, scheduler)


def fill_from_full(target: dict[str, torch.Tensor], full: dict[str, torch.Tensor], source: Path) -> None:
    """Copy whole tensors ``full`` (canonical names) into this rank's pieces ``target`` (``canonical_state``):
    a DTensor takes the slice its placements give this rank, a plain tensor the whole value. How a one-process
    (safetensors) checkpoint is resumed in a distributed layout.

    Raises:
        GenoctxError: a missing name or a shape that differs (named with ``source``).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.no_grad():
        for k, t in target.items():
            if k not in full:
                raise GenoctxError(f"{source}: has no {k!r} for this model")
            src = full[k]
            if isinstance(t, DTensor):
                if tuple(src.shape) != tuple(t.shape):
                    raise GenoctxError(f"{source}: {k} has shape {tuple(src.shape)}, this model {tuple(t.shape)}")
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                piece = src[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                t.to_local().copy_(piece)
            else:
                if src.numel() != t.numel():
                    raise GenoctxError(f"{source}: {k} has shape {tuple(src.shape)}, this model {tuple(t.shape)}")
                t.copy_(src.view_as(t))


def _optimizer_by_name(ckpt: Path, model, optimizer) -> tuple[dict[str, torch.Tensor], dict | None]:
    """``optim.<name>.<key>`` tensors of a one-process checkpoint's ``optimizer.pt`` (memory-mapped: a rank reads
    only the pages of the slices it copies) and its scheduler state. Parameters are in ``build_optimizer``'s
    order, by their one-device names."""
    opt = read_optimizer(Path(ckpt) / "optimizer.pt", mmap=True)
    out: dict[str, torch.Tensor] = {}
    if optimizer is not None and opt.get("optimizer"):
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        for idx, st in opt["optimizer"]["state"].items():
            name = order[int(idx)]
            for k, v in st.items():
                out[f"optim.{name}.{k}"] = v if torch.is_tensor(v) else torch.tensor(float(v))
    return out, opt.get("scheduler")


def load_any(ckpt: Path, model, optimizer, scheduler, dims, held: set[str] | None = None) -> None:
    """Restore a distributed model (``apply_parallel`` done, optimizer built) from a checkpoint of any layout: DCP
    (``load_sharded``) or a one-process safetensors checkpoint (each rank reads its slices of ``model.safetensors``
    with ``get_slice`` and of the memory-mapped ``optimizer.pt``: never the whole model). ``held``: the checkpoint
    holds only what trains (these names), over the base the model was built from."""
    if is_sharded(ckpt):
        load_sharded(ckpt, model, optimizer, scheduler, dims, held=held)
        return
    from ..parallel.build import persistent_targets, read_checkpoint_slices

    targets = persistent_targets(model, dims)
    if model.lm_head.weight is model.embed_tokens.weight:
        targets.pop(TIED_HEAD, None)
    if held is not None:  # exactly what trains (the one-process loader's rule), read over the base
        from safetensors import safe_open

        with safe_open(str(Path(ckpt) / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys()) - {TIED_HEAD}
        if keys != held:
            odd = sorted(keys - held) or sorted(held - keys)
            raise GenoctxError(f"{ckpt}/model.safetensors: holds only what trains, but not this run's: "
                               f"{'unexpected' if keys - held else 'missing'} {odd[0]}")  # fmt: skip
    read_checkpoint_slices(Path(ckpt) / "model.safetensors", targets, partial=held is not None)
    full, sched = _optimizer_by_name(ckpt, model, optimizer)
    fill_from_full({k: v for k, v in canonical_state(model, optimizer, dims).items() if k.startswith("optim.")},
                   full, Path(ckpt) / "optimizer.pt")  # fmt: skip
    restore_schedule(scheduler, sched)


def lazy_state(ckpt: Path, cfg, lora_scale: float | None = None):
    """The model of a DCP checkpoint as a ``genoctx.model.hf.LazyState`` (``save_hf`` reads one tensor at a time).

    ``lora_scale`` (``train.lora_alpha / train.lora_rank``; a LoRA run's ``genoctx export --merge``): every adapted
    weight is merged as it is read, ``W + lora_scale · B A`` (a linear's ``X.weight`` [out, in] with ``X.lora_A``
    [r, in] and ``X.lora_B`` [out, r]; an experts stack ``X`` [E, out, in] with ``X_lora_A`` [E, r, in] and
    ``X_lora_B`` [E, out, r], per expert), summed in W's dtype promoted to fp32 and rounded once, as
    ``genoctx.model.lora.merge_lora`` (``merge_weight``); the adapters themselves are not in the state. Each
    read holds W and its two small adapters, never the whole model."""
    from ..model.hf import LazyState
    from ..model.lora import is_lora_name, merge_weight
    from ..parallel.build import _adapters_to_merge

    keys = checkpoint_keys(ckpt)
    meta = {k[len("model.") :]: (tuple(shape), dt) for k, (shape, dt) in keys.items() if k.startswith("model.")}
    held = meta["embed_tokens.weight"][1]
    pairs = {}
    if lora_scale is not None:
        plain = {k: None for k in meta if not is_lora_name(k)}
        pairs = _adapters_to_merge(set(meta), plain)
        meta = {k: v for k, v in meta.items() if k in plain}

    def read(name: str) -> torch.Tensor:
        if name not in pairs:
            return read_full_tensors(ckpt, names=[name])[name]
        a, b = pairs[name]
        got = read_full_tensors(ckpt, names=[name, a, b])
        return merge_weight(got[name], got[a], got[b], lora_scale)

    return LazyState(cfg, read, meta, held)


def adapter_model(ckpt: Path, recipe: Recipe):
    """The model of a DCP checkpoint of a LoRA run as ``genoctx.model.peft_export.save_peft`` reads it, without the
    whole model: built on the meta device with the run's adapters (``train.lora_*``), then only what a PEFT adapter
    folder holds read from ``dcp/`` (``read_full_tensors``, whole tensors, one process): every adapter (linear
    ``lora_A`` [r, in] / ``lora_B`` [out, r], experts' [E, r, in] / [E, out, r]) and every tensor of the modules
    saved whole (``peft_export.whole_modules`` of the groups ``train.trainable`` names besides ``lora``). Every other
    tensor stays on meta, in the checkpoint's dtype (the export's ``keep``). Works alike for a whole DCP checkpoint
    and for one holding only what trains (whose base the caller has checked: the adapter folder holds nothing of it).

    Raises:
        GenoctxError: a tensor the folder needs that the checkpoint lacks, or unreadable files (named).
    """
    from ..model.groups import LORA, parse_trainable
    from ..model.lora import LoRASpec, is_lora_name
    from ..model.peft_export import whole_modules
    from ..parallel.build import build_model

    t = recipe.train
    model = build_model(recipe.model, None, materialize=False,
                        lora=LoRASpec(t.lora_rank, t.lora_alpha, t.lora_targets, t.seed))  # fmt: skip
    keys = checkpoint_keys(ckpt)
    whole = whole_modules(model, {g for g in parse_trainable(t.trainable) if g != LORA})
    names = [n for n, _ in model.named_parameters() if is_lora_name(n)]
    names += [f"{w}.{k}" for w in whole for k in model.get_submodule(w).state_dict()]
    got = read_full_tensors(ckpt, names=names)
    with torch.no_grad():
        for name, _ in list(model.named_parameters()) + list(model.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            mod = model.get_submodule(owner)
            slot = mod._parameters if leaf in mod._parameters else mod._buffers
            if name in got:
                value = got[name]
            elif "model." + name in keys:  # meta, in the dtype the checkpoint holds it in
                value = torch.empty(keys["model." + name][0], dtype=keys["model." + name][1], device="meta")
            else:
                continue
            slot[leaf] = torch.nn.Parameter(value, requires_grad=False) if slot is mod._parameters else value
    return model
