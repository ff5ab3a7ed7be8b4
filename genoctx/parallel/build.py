"""The one way to make a model on a mesh: meta device -> parallelize -> to_empty -> fill this rank's shards.

Every entry point (``genoctx train`` from scratch, ``--init`` an HF base or a genoctx run, ``--resume``, one
process or a Ray worker) builds its model with ``build_model``, torchtitan's order:

1. ``HybridLM(cfg)`` on the meta device (no memory, any size; the init seed is drawn from torch's generator as
   one process draws it: ``genoctx.model.init``);
2. ``apply_parallel`` (expert parallel, context parallel, ``torch.compile`` per layer, activation checkpointing,
   FSDP2, in that order): the parameters become this rank's pieces, still on meta;
3. ``to_empty(device)``: only this rank's pieces are allocated (FSDP2 shards, its block of routed experts; the
   unsharded dense parameters of a layout without FSDP);
4. fill this rank's pieces (``genoctx.parallel.state.local_targets`` names each piece's place in the one-device
   tensor) from one ``source``:

   - ``Fresh()``: layout-free draws (``genoctx.model.init.fill_fresh``): the same model in one process and under
     every FSDP / EP / CP layout for the same seed;
   - ``FromHF(path)``: the rank's slices of an HF checkpoint (``genoctx.model.hf.read_hf_into``: published
     per-expert names into the local part of the grouped ``[E, ...]`` tensors, the VL prefix, fp8 blocks, MTP and
     vision skipped and said so, one file or an index of shards);
   - ``FromCheckpoint(path)``: a genoctx checkpoint, DCP (``dcp.load`` of the rank's pieces,
     ``genoctx.parallel.state.canonical_state``) or one-process safetensors (slices read with ``get_slice``);
   - ``Zeros()``: zeros, for a checkpoint loaded right after (``--resume`` loads model and optimizer together).

No rank allocates more than its own pieces, one tensor being read (or one row block being drawn) and, later in the
step, one decoder layer's unsharded parameters (FSDP2's all-gather). Errors while filling are agreed on by every
rank (``agree``): a checkpoint tensor missing or misshapen for one rank's slice is the same one-line
``GenoctxError`` on every rank, never a rank waiting in a collective for one that died.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import AgreedError, GenoctxError
from ..model.config import ModelConfig
from ..model.lora import merge_weight
from ..model.model import HybridLM
from .mesh import ParallelDims
from .state import DCP_DIR, TIED_HEAD, canonical_state, is_sharded, local_targets


@dataclass(frozen=True)
class Fresh:
    """A fresh initialisation (``genoctx.model.init``) with the model seed drawn from torch's generator."""


@dataclass(frozen=True)
class Zeros:
    """Every piece zero: a checkpoint is loaded into the model right after (``--resume``)."""


@dataclass(frozen=True)
class FromHF:
    """An HF glm5_next directory (``config.json`` and safetensors); ``cfg`` must be its architecture."""

    path: Path


@dataclass(frozen=True)
class FrozenFP8:
    """``train.frozen_dtype: fp8``: the frozen matmul weights ``names`` (``HybridLM.named_parameters`` names) held as
    block-scaled fp8 in ``block`` (rows, columns) scale blocks (``genoctx.model.fp8``)."""

    names: tuple[str, ...]
    block: tuple[int, int] = (128, 128)


FP8_ONE_PROCESS = (
    "train.frozen_dtype: fp8 with train.compile runs in one process only (issue 44): the fp8 holders' per-use "
    "dequantization is not compiled on a mesh; set train.compile=false or train.frozen_dtype=bf16"
)


@dataclass(frozen=True)
class FromCheckpoint:
    """A genoctx checkpoint directory (``state.json`` with ``dcp/`` or ``model.safetensors``): weights only.
    ``adapters``: also read the LoRA adapters (a LoRA run's checkpoint into a model built with its ``lora``, as
    evaluation does); False fills the base alone and ``build_model`` draws fresh adapters (``--init`` from a run)."""

    path: Path
    adapters: bool = False


def agree(dims: ParallelDims | None, fn):
    """Run ``fn()`` on every rank; if it raised ``GenoctxError`` on any rank, raise the first rank's message on
    every rank (one ``all_gather_object`` over the mesh), so no rank goes on into a collective alone.

    Raises:
        AgreedError: (a ``GenoctxError``) ``fn`` raised one on some rank: this rank's own message, else the first
            failing rank's as ``"rank R: ..."``; on one device, ``fn``'s own ``GenoctxError``.
    """
    import torch.distributed as dist

    from . import collectives as coll

    err, out = None, None
    try:
        out = fn()
    except GenoctxError as e:
        err = str(e)
    if dims is not None and dims.is_distributed:
        errs = [None] * dist.get_world_size()
        coll.all_gather_object(errs, err)
        first = next(((r, e) for r, e in enumerate(errs) if e is not None), None)
        if err is None and first is not None:  # another rank's error: said with its rank
            r, e = first
            raise AgreedError(e if e.startswith("rank ") else f"rank {r}: {e}")
        if err is not None:
            raise AgreedError(err)
    if err is not None:
        raise GenoctxError(err)
    return out


def partial_base(ckpt: Path):
    """The base of a genoctx checkpoint that holds only what trains (state.json ``"holds": "trainable"``, its base
    named by ``init``: ``genoctx.train.checkpoint``): ``FromHF`` or ``FromCheckpoint``; None for a whole one (or a
    state.json that does not read: the checkpoint's own readers name it). Whether the base is unchanged is checked
    above this module (``genoctx.train.checkpoint.check_base``), before any rank builds."""
    import json

    try:
        state = json.loads((Path(ckpt) / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("holds") != "trainable":
        return None
    init = state.get("init") or {}
    if not init.get("path"):
        raise GenoctxError(f"{ckpt}/state.json: holds only what trains but names no base (init.path)")
    return FromCheckpoint(Path(init["path"])) if init.get("kind") == "genoctx" else FromHF(Path(init["path"]))


def _adapters_to_merge(keys: set, targets: dict) -> dict[str, tuple[str, str]]:
    """The LoRA adapters a checkpoint file holds (``keys``) that the model being filled (``targets``) has not: ``{base
    weight name: (A name, B name)}`` (``q_proj.weight`` <- ``q_proj.lora_A``/``lora_B``, ``experts.gate_up_proj`` <-
    ``experts.gate_up_proj_lora_A``/``_lora_B``; ``genoctx.model.lora``) for every weight the model has."""
    out = {}
    for k in keys:
        if k.endswith("lora_A") and k not in targets:
            stem = k[: -len("lora_A")]
            base = stem + "weight" if stem.endswith(".") else stem.rstrip("_")
            if base in targets and stem + "lora_B" in keys:
                out[base] = (k, stem + "lora_B")
    return out


def _a_box(box: tuple) -> tuple:
    """The box of A (``[r, in]`` or ``[E, r, in]``) that a weight box (``[out, in]`` / ``[E, out, in]``) needs."""
    return (slice(None), box[-1]) if len(box) == 2 else (box[0], slice(None), box[2])


def _b_box(box: tuple) -> tuple:
    """The box of B (``[out, r]`` or ``[E, out, r]``) that a weight box needs."""
    return (box[0], slice(None)) if len(box) == 2 else (box[0], box[1], slice(None))


def _lora_scale(ckpt: Path) -> float:
    """``train.lora_alpha / train.lora_rank`` of a checkpoint's recipe.yaml (1.0 when it has no LoRA keys)."""
    import yaml

    try:
        t = (yaml.safe_load((Path(ckpt) / "recipe.yaml").read_text()) or {}).get("train") or {}
    except (OSError, yaml.YAMLError):
        return 1.0
    return float(t.get("lora_alpha", 32.0)) / int(t.get("lora_rank", 16) or 1)


def read_checkpoint_slices(path: Path, targets: dict, partial: bool = False, lora_scale: float = 1.0) -> None:
    """A one-process genoctx checkpoint (``model.safetensors``, one-device names): each target's box read with
    ``get_slice``. ``partial``: the file holds only what trains (``partial_base``): the targets it has are read,
    the others keep their value (the base's), and a tensor the model has no target for is an error. LoRA adapters
    the model has not (``--init`` of a LoRA run into a model without them) are merged into their weights' boxes,
    ``W + lora_scale · B A`` as ``genoctx.model.lora.merge_lora`` (the run's recipe: ``lora_alpha / lora_rank``).
    Raises ``GenoctxError`` naming the tensor and file when one is missing or misshapen."""
    from safetensors import SafetensorError

    from ..model.hf import SliceReader

    reader = SliceReader(budget=max((t.numel() * t.element_size() for t, _, _ in targets.values()), default=1))
    try:
        h = reader.handle(path)
        keys = set(h.keys())
        adapters = _adapters_to_merge(keys, targets)
        extra = sorted(keys - set(targets) - {TIED_HEAD} - {n for pair in adapters.values() for n in pair})
        if partial and extra:
            raise GenoctxError(f"{path}: holds {extra[0]}, which this model has not")
        merged = {k: targets[k] for k in adapters}
        if partial:
            targets = {k: v for k, v in targets.items() if k in keys}
        for name, (local, shape, box) in targets.items():
            if name not in keys:
                raise GenoctxError(f"{path}: tensor {name} is missing (the checkpoint does not match this model)")
            got = tuple(reader.handle(path).get_slice(name).get_shape())
            if got != tuple(shape):
                raise GenoctxError(f"{path}: tensor {name} has shape {got}, this model {tuple(shape)}")
            if local.numel():
                with torch.no_grad():
                    local.copy_(reader.read(path, name, box))
        for name, (a_name, b_name) in adapters.items():  # a LoRA run's adapters onto weights (read or the base's)
            local, shape, box = merged[name]
            if local.numel():
                a, b = reader.read(path, a_name, _a_box(box)), reader.read(path, b_name, _b_box(box))
                with torch.no_grad():
                    local.copy_(merge_weight(local, a, b, lora_scale))
    except (SafetensorError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GenoctxError(f"{path}: not a readable safetensors file ({first})") from None
    finally:
        reader.close()


def _load_dcp_weights(ckpt: Path, model: nn.Module, dims, partial: bool = False, adapters: bool = False) -> None:
    """The model's tensors of a DCP checkpoint (any layout it was saved in) into this rank's pieces; ``partial``:
    those it holds (``read_checkpoint_slices``); the LoRA adapters only with ``adapters``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from ..model.lora import is_lora_name

    sd = canonical_state(model, None, dims)
    sd = {k: v for k, v in sd.items() if k.startswith("model.") and (adapters or not is_lora_name(k))}
    if partial:
        try:
            keys = {k for k in FileSystemReader(str(Path(ckpt) / DCP_DIR)).read_metadata().state_dict_metadata
                    if k.startswith("model.")}  # fmt: skip
        except Exception as e:
            raise GenoctxError(f"{ckpt}/{DCP_DIR}/.metadata: unreadable ({dcp_error_line(e)})") from None
        extra = sorted(k for k in keys - set(sd) if not is_lora_name(k))
        if extra:
            raise GenoctxError(f"{ckpt}/{DCP_DIR}: holds {extra[0][6:]}, which this model has not")
        sd = {k: v for k, v in sd.items() if k in keys}
    else:
        try:
            keys = set(FileSystemReader(str(Path(ckpt) / DCP_DIR)).read_metadata().state_dict_metadata)
        except Exception:
            keys = set()  # dcp.load below names what is unreadable
    lora = sorted(k[6:] for k in keys if k.startswith("model.") and k not in sd and is_lora_name(k))
    if lora:  # a distributed LoRA run's adapters into weights: merging boxes of DCP tensors is not built; never lost
        raise GenoctxError(f"{ckpt}: a LoRA run's distributed checkpoint (adapters such as {lora[0]}): start from it "
                           "with `genoctx export --merge` of it, then --init the export")  # fmt: skip
    try:
        dcp.load(sd, checkpoint_id=str(Path(ckpt) / DCP_DIR), no_dist=dims is None or not dims.is_distributed)
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps every rank's
        raise GenoctxError(f"{ckpt}/{DCP_DIR}: cannot load it into this model ({dcp_error_line(e)})") from None


def dcp_error_line(e: BaseException) -> str:
    """One line for a failed ``dcp.load``: the first failing rank's own error (``CheckpointException.failures``:
    rank -> (exception, traceback)), e.g. ``rank 1: EOFError`` for a shard file cut short; else the first line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        err = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        text = str(err).strip().splitlines()
        return f"rank {rank}: {type(err).__name__}" + (f": {text[0]}" if text else "")
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def base_targets(model: nn.Module, dims, buffers: bool = True) -> dict:
    """``local_targets`` without the LoRA adapters (``genoctx.model.lora.is_lora_name``): what a source fills. The
    adapters are drawn afterwards (``build_model``'s ``lora``) or loaded with the run's checkpoint (``--resume``)."""
    from ..model.lora import is_lora_name

    return {k: v for k, v in local_targets(model, dims, buffers=buffers).items() if not is_lora_name(k)}


def persistent_targets(model: nn.Module, dims, adapters: bool = True) -> dict:
    """``local_targets`` of the tensors a checkpoint stores (parameters and persistent buffers); without
    ``adapters``, the base's alone (``base_targets``: what ``fill`` reads from an HF model or an ``--init`` run)."""
    keep = set(model.state_dict().keys())
    targets = local_targets(model, dims) if adapters else base_targets(model, dims)
    return {k: v for k, v in targets.items() if k in keep}


def fill(model: HybridLM, dims: ParallelDims | None, source, quantize: tuple | None = None) -> dict:
    """Fill this rank's pieces of ``model`` (allocated, parallelism applied) from ``source`` (module docstring).
    Non-persistent buffers (router load counts) start at 0. Returns what was done, for the log and tests:
    ``{"source", "path", "skipped"}``. ``quantize`` (``train.frozen_dtype: fp8`` on a mesh): ``(names, block)``,
    weights held in fp8 that ``source`` holds in another dtype (a fresh init, a bf16 base): this rank's box of each
    is filled as a plain weight, then quantized into its holder (``_quantizing``).

    Raises:
        GenoctxError: a missing, misshapen or unreadable tensor (named with its file); not agreed across ranks
            here (``build_model`` does that).
    """
    from ..model.init import fill_fresh

    for b in model.buffers():
        b.zero_()
    if isinstance(source, Zeros):
        for local, _, _ in local_targets(model, dims, buffers=False).values():
            local.zero_()
        return {"source": "zeros", "path": None, "skipped": None}
    if isinstance(source, Fresh):
        targets = base_targets(model, dims)
        temps = _quantizing(model, targets, quantize[0]) if quantize else {}
        fill_fresh(targets, _fresh_spec(model), model.init_seed)
        _quantize_into(model, temps, quantize[1] if quantize else (1, 1))
        return {"source": "fresh", "path": None, "skipped": None, "seed": model.init_seed}
    if isinstance(source, FromHF):
        from ..model.hf import read_hf_into

        # warn=False: what the index leaves out was said once, by the driver's check_hf (genoctx.train.init,
        # genoctx.eval.distributed) before any rank started
        targets = persistent_targets(model, dims, adapters=False)
        temps = _quantizing(model, targets, quantize[0]) if quantize else {}
        info = read_hf_into(source.path, model.cfg, targets, warn=False)
        _quantize_into(model, temps, quantize[1] if quantize else (1, 1))
        return {"source": "hf", "path": str(source.path), "skipped": info["skipped"]}
    if isinstance(source, FromCheckpoint):
        ckpt = Path(source.path)
        base = partial_base(ckpt)
        if base is not None:  # it holds only what trained: its base first (a chain of such runs followed)
            fill(model, dims, base, quantize)
        if is_sharded(ckpt):
            _load_dcp_weights(ckpt, model, dims, partial=base is not None, adapters=source.adapters)
        else:
            targets = persistent_targets(model, dims, source.adapters)
            if model.lm_head.weight is model.embed_tokens.weight:
                targets.pop(TIED_HEAD, None)
            read_checkpoint_slices(ckpt / "model.safetensors", targets, partial=base is not None,
                                   lora_scale=_lora_scale(ckpt))  # fmt: skip
        return {"source": "checkpoint", "path": str(ckpt), "skipped": None, "base": base and str(base.path)}
    raise TypeError(f"build_model: unknown source {source!r}")


def _fresh_spec(model: HybridLM) -> dict:
    """``init_spec(model)``, by one-device names; with fp8 holders (``train.frozen_dtype: fp8`` on a mesh) the held
    weights' entries come from the same model built plain on meta (torch's generator left as it was)."""
    from ..model.fp8 import FP8Weight
    from ..model.init import init_spec

    if not any(isinstance(m, FP8Weight) for m in model.modules()):
        return init_spec(model)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        plain = HybridLM(model.cfg)
    return init_spec(plain)


def build_model(
    cfg: ModelConfig,
    dims: ParallelDims | None = None,
    *,
    source=None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    offload_optimizer: bool = False,
    materialize: bool = True,
    cp_chunk_tokens: int | None = None,
    compile: bool = False,
    offload_activations: bool = False,
    frozen_fp8: FrozenFP8 | None = None,
    lora=None,
) -> HybridLM:
    """Make ``HybridLM(cfg)`` on the mesh of ``dims``: meta device, ``apply_parallel``, ``to_empty``, fill this
    rank's pieces from ``source`` (module docstring). A collective when ``dims`` is distributed (FSDP2's
    ``fully_shard`` and the fill's agreement run on every rank).

    Args:
        cfg: the architecture, with its compute knobs.
        dims: the mesh (``init_parallel``); None = one device (the mesh of size 1: nothing applied).
        source: ``Fresh()`` (default), ``Zeros()``, ``FromHF(path)`` or ``FromCheckpoint(path)``.
        device: where the pieces live (``"cpu"`` or a CUDA device).
        dtype: the parameters' dtype (fp32 masters; the fp32 islands never below fp32: ``cast_model``).
        activation_checkpointing, param_dtype, offload_optimizer: ``apply_parallel``'s.
        materialize: False stops after step 2 (the model stays on meta): the dry run counts its pieces.
        cp_chunk_tokens: under CP, stream each piece through a mixing layer in chunks of this many tokens
            (``apply_parallel``; forward-only evaluation).
        compile: ``torch.compile`` each decoder layer's forward (``genoctx.parallel.compile.apply_compile``,
            ``train.compile``; training passes it, evaluation does not).
        offload_activations: the checkpointed layers' inputs in host memory (``train.offload_activations``;
            ``genoctx.parallel.offload``); needs ``activation_checkpointing``.
        frozen_fp8: these weights held as fp8 (``_hold_fp8``): filled straight from an HF base's fp8 blocks, any
            other source (a base stored in bf16, a fresh init) quantized once filled; a genoctx checkpoint or
            ``Zeros`` fills the holders as they are. With ``offload_optimizer`` the holders then live in host
            memory and each use copies its fp8 tensor to ``device`` (``genoctx.model.fp8.hold_on_host``). On a
            mesh the holders are made on meta before parallelism (FSDP2 leaves them whole: buffers; expert
            parallelism slices the routed experts' holders on E with the experts) and each rank fills or quantizes
            only its own (``fill``'s ``quantize``).
        lora: a ``genoctx.model.lora.LoRASpec`` (``train.trainable: lora``) or None. The adapters are added on the
            meta device, before parallelism (expert parallelism splits the experts' adapters with them, FSDP2 shards
            them as the other parameters), the source fills the base (never the adapters), then every rank draws its
            pieces of the one-process adapters for ``lora.seed`` (``genoctx.model.lora.reset_lora`` with this rank's
            targets: A kaiming-uniform, B zeros; the same values under every layout). ``Zeros()`` leaves them zero
            (a checkpoint holding them is loaded next); ``FromCheckpoint(path, adapters=True)`` reads them.

    Returns:
        The model; ``model.build_info`` says what filled it (``fill``'s dict) and ``model.parallel_handles`` holds
        ``apply_parallel``'s handles.

    Raises:
        GenoctxError: the source is unreadable or does not fit this model (the same message on every rank).
        GenoctxError: an HF base whose fp8 blocks do not fit.
        GenoctxError: LoRA targets that match nothing (naming ``train.lora_targets``).
        ValueError: ``offload_activations`` without ``activation_checkpointing``.
    """
    from ..model.model import cast_model
    from .fsdp import apply_parallel

    source = Fresh() if source is None else source
    with torch.device("meta"):
        model = HybridLM(cfg)
    if dtype != torch.float32:
        cast_model(model, dtype)
    quantize_after = _hold_fp8(model, dims, source, frozen_fp8)
    if lora is not None:  # on meta, before parallelism (module docstring)
        from ..model.lora import apply_lora

        try:
            apply_lora(model, lora.rank, lora.alpha, lora.targets, seed=lora.seed)
        except ValueError as e:
            raise GenoctxError(f"train.lora_targets {lora.targets!r}: {e}") from None
    handles = []
    if dims is not None:
        handles = apply_parallel(model, dims, activation_checkpointing=activation_checkpointing,
                                 param_dtype=param_dtype, offload_optimizer=offload_optimizer,
                                 cp_chunk_tokens=cp_chunk_tokens, compile=compile,
                                 offload_activations=offload_activations)  # fmt: skip
    else:
        if offload_activations and not activation_checkpointing:
            raise ValueError("offload_activations offloads the checkpointed layers' inputs: it needs "
                             "activation_checkpointing=True")  # fmt: skip
        if compile:
            from .compile import apply_compile

            apply_compile(model)
        if activation_checkpointing:
            from .fsdp import apply_ac

            apply_ac(model, offload=offload_activations)
    model.parallel_handles = handles
    if not materialize:
        model.build_info = {"source": "meta", "path": None, "skipped": None}
        return model
    offloaded = offload_optimizer and dims is not None and dims.fsdp
    model.materialize("cpu" if offloaded else device)  # offloaded shards live in host memory (CPUOffloadPolicy)
    if offloaded:  # buffers (router biases, load counts) are not FSDP's: they stay on the compute device
        for m in model.modules():
            for n, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[n] = b.to(device)
    quantize = (quantize_after, frozen_fp8.block) if quantize_after and dims is not None else None
    model.build_info = agree(dims, lambda: fill(model, dims, source, quantize))
    if (
        quantize_after and dims is None
    ):  # (named as on the plain model: activation checkpointing has wrapped the layers since)
        from ..model.fp8 import freeze_to_fp8

        rest = set(quantize_after)
        plain = lambda n: n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731
        freeze_to_fp8(model, lambda n, p: plain(n) in rest, frozen_fp8.block)
    if frozen_fp8 is not None:
        model.build_info["fp8"] = {"held": len(frozen_fp8.names), "quantized": len(quantize_after),
                                   "block": list(frozen_fp8.block)}  # fmt: skip
        if offload_optimizer:  # the frozen fp8 weights in host memory too, copied per use (genoctx.model.fp8)
            from ..model.fp8 import hold_on_host

            model.build_info["fp8"]["host_bytes"] = hold_on_host(model, device)
    if lora is not None and not isinstance(source, Zeros) and not getattr(source, "adapters", False):
        from ..model.lora import reset_lora

        reset_lora(model, lora.seed, local_targets(model, dims, buffers=False))
    if isinstance(source, FromHF):
        from ..model.hf import log_skipped

        log_skipped(source.path, model.build_info["skipped"], cfg)
    return model


def _hold_fp8(model: HybridLM, dims, source, frozen: FrozenFP8 | None) -> list[str]:
    """``build_model``'s fp8 holders, on the meta device before anything is allocated: empty holders
    (``genoctx.model.fp8.freeze_to_fp8``) for the weights the source fills as fp8 (every one of ``frozen.names`` from
    a genoctx checkpoint or ``Zeros``; from an HF base, those it stores as fp8 blocks: ``fp8_weights``). Returns the
    rest, to quantize once filled (a fresh init, a base stored in bf16). On a mesh (``dims``) every one of
    ``frozen.names`` gets its holder now, before parallelism (a parameter FSDP2 has sharded cannot be replaced
    after), and the rest are quantized by ``fill`` from their filled values, slice by slice.
    """
    if frozen is None:
        return []
    from ..model.fp8 import freeze_to_fp8

    if isinstance(source, Fresh):
        now: list[str] = []
    elif isinstance(source, FromHF):
        from ..model.hf import fp8_weights

        stored = set(fp8_weights(source.path, model.cfg))
        now = [n for n in frozen.names if n in stored]
    else:
        now = list(frozen.names)
    freeze_to_fp8(model, frozen.names if dims is not None else now, frozen.block)
    return [n for n in frozen.names if n not in set(now)]


def _plain(name: str) -> str:
    """A parameter's one-device name (without activation checkpointing's or ``torch.compile``'s infix)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _quantizing(model: nn.Module, targets: dict, names: list[str]) -> dict:
    """``fill``'s ``quantize`` on a mesh: the holders (``<name>_fp8.weight`` / ``.scale_inv``) of ``names`` leave
    ``targets`` and each weight ``name`` gets a temporary of this rank's box of it, in the dtype the holder
    dequantizes to, filled as a plain weight would be. Returns ``{name: temporary}`` (``_quantize_into``)."""
    from ..model.fp8 import SUFFIX

    by_plain = {_plain(k): k for k in targets}
    temps = {}
    for name in names:
        wkey = by_plain.get(f"{name}{SUFFIX}.weight")
        if wkey is None:
            continue
        local, shape, box = targets.pop(wkey)
        targets.pop(wkey[: -len("weight")] + "scale_inv")
        holder = model.get_submodule(wkey[: -len(".weight")])
        temps[wkey[: -len(".weight")]] = t = torch.empty(local.shape, dtype=holder.dtype, device=local.device)
        targets[name] = (t, shape, box)
    return temps


@torch.no_grad()
def _quantize_into(model: nn.Module, temps: dict, block: tuple[int, int]) -> None:
    """Quantize each temporary of ``_quantizing`` into its holder (``quantize_fp8``; a holder is whole on its last
    two dims and sliced only on experts, whose blocks never span two: each rank's bytes and scales equal its rows of
    the one-process holder's), one weight at a time."""
    from ..model.fp8 import quantize_fp8

    for key in list(temps):
        holder = model.get_submodule(key)
        q, scale = quantize_fp8(temps.pop(key), block)
        holder.weight.copy_(q)
        holder.scale_inv.copy_(scale)
