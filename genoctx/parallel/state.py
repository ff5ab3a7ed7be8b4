"""The layout-free view of a model on the mesh: every tensor by its one-device name, with this rank's piece of it.

Two views, one rule (a rank's piece of tensor ``name`` is where its FSDP2 placements and, for routed experts, its
expert-parallel block put it in the one-device tensor):

- ``local_targets(model, dims)``: ``name -> (local tensor, global shape, box)``, the box being this rank's slice of
  the global tensor (one ``slice`` per dim). What ``genoctx.parallel.build`` fills (fresh draws, HF slices,
  one-process checkpoints) and what the dry run counts.
- ``canonical_state(model, optimizer, dims)``: the state dict of ``torch.distributed.checkpoint`` (DCP):
  ``model.<name>`` and ``optim.<name>.<key>``, each a DTensor of the global shape (or a plain tensor when
  replicated), sharing memory with the model and optimizer so that ``dcp.load`` restores them in place
  (``genoctx.train.sharded`` saves and loads it).

Under expert parallelism a routed expert's parameter holds the rank's block ``[ep_rank E / ep, (ep_rank + 1) E /
ep)`` of the ``[E, ...]`` tensor (``genoctx.parallel.experts.apply_ep``), FSDP-sharded ``Shard(0)`` over
``dp_shard x cp`` inside it (folded EP: over ``efsdp``, ``Shard(1)`` where the block's experts do not split evenly);
it is presented as a DTensor ``Shard(0)`` over ``ep`` (and the FSDP placement over the expert shard) of the global
tensor, on ``dims.expert_dtensor_mesh``.
"""

from __future__ import annotations

import torch

from .fsdp import is_expert_parameter

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
TIED_HEAD = "lm_head.weight"  # not stored when tied to embed_tokens.weight
DCP_DIR = "dcp"  # a checkpoint's torch.distributed.checkpoint shards (genoctx.train.sharded writes them)


def is_sharded(ckpt) -> bool:
    """True for a DCP checkpoint directory (``dcp/.metadata`` present)."""
    from pathlib import Path

    return (Path(ckpt) / DCP_DIR / ".metadata").is_file()


def _expert_dtensor(local: torch.Tensor, module, dims) -> torch.Tensor:
    """This rank's rows of a routed-expert tensor as a DTensor of the global ``[E, ...]`` shape (module doc)."""
    from torch.distributed.tensor import DTensor, Shard

    E = module.ep_size * module.n_local_experts  # set by genoctx.parallel.experts.apply_ep
    mesh = dims.expert_dtensor_mesh
    shape = torch.Size([E, *local.shape[1:]])  # an FSDP DTensor's shape is the whole block's
    if hasattr(local, "to_local"):  # FSDP-sharded block: its FSDP placement (Shard(0) or Shard(1)) inside the block
        placements = [Shard(0), local.placements[-1]]
        local = local.to_local()
    else:
        placements = [Shard(0)]
    stride = torch.empty(0).new_empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _holder_dtensor(local: torch.Tensor, n_experts: int, dims) -> torch.Tensor:
    """This rank's experts of an fp8 holder's buffer (``[El, ...]``; FSDP2 never shards a buffer: replicated over the
    expert shard) as a DTensor of the global ``[E, ...]`` shape on ``dims.expert_dtensor_mesh``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = dims.expert_dtensor_mesh
    shape = torch.Size([n_experts, *local.shape[1:]])
    stride = torch.empty(0).new_empty(shape, device="meta").stride()
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _box(shape, offset, local_shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))


def local_targets(model, dims=None, buffers: bool = True) -> dict[str, tuple[torch.Tensor, tuple, tuple]]:
    """This rank's piece of every parameter (and, with ``buffers``, buffer) of ``model``, by one-device name.

    Args:
        model: a ``HybridLM`` after ``apply_parallel`` (or plain: every tensor whole), on any device, meta included.
        dims: the ``ParallelDims`` it was parallelised with (None: one device).
        buffers: include buffers (persistent and not: router biases, load counts).

    Returns:
        ``name -> (local, global_shape, box)``: ``local`` the tensor this rank holds (an FSDP parameter's
        ``_local_tensor``, written in place), ``global_shape`` the one-device shape (a tuple of ints), ``box`` this
        rank's slice of it (tuple of ``slice``). A tied ``lm_head.weight`` is listed once, as the embedding.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    modules = dict(model.named_modules())
    out = {}
    for name, p in model.named_parameters():
        expert = is_expert_parameter(p) and dims is not None and dims.ep > 1
        if isinstance(p, DTensor):
            local = p._local_tensor
            shape = tuple(p.shape)
            lshape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            assert tuple(lshape) == tuple(local.shape), (name, lshape, local.shape)
        else:
            local, shape, offset = p.data, tuple(p.shape), (0,) * p.dim()
        if expert:  # the rank's block of experts inside the [E, ...] tensor
            ex = modules[name.rsplit(".", 1)[0]]
            shape = (ex.ep_size * ex.n_local_experts, *shape[1:])
            offset = (ex.expert_offset + offset[0], *offset[1:])
        out[name] = (local, shape, _box(shape, offset, local.shape))
    if buffers:
        for name, b in model.named_buffers():
            shape, offset = tuple(b.shape), (0,) * b.dim()
            block = _ep_block(modules, name)
            if block is not None:  # an fp8 holder's rows of this rank's experts (genoctx.model.fp8.FP8Weight.experts)
                shape, offset = (block[1], *shape[1:]), (block[0], *offset[1:])
            out[name] = (b, shape, _box(shape, offset, b.shape))
    return out


def _ep_block(modules: dict, name: str) -> tuple[int, int] | None:
    """``(first expert, all experts)`` when buffer ``name`` is the ``weight`` / ``scale_inv`` of an fp8 holder that
    expert parallelism sliced (``train.frozen_dtype: fp8``), else None."""
    return getattr(modules.get(name.rpartition(".")[0]), "ep_block", None)


def canonical_state(model, optimizer, dims) -> dict[str, torch.Tensor]:
    """The layout-free state dict of this rank (module docstring): ``model.<name>`` and ``optim.<name>.<key>``.

    Tensors share memory with the parameters and optimizer state, so ``dcp.load`` into this dict restores them.
    Creates zero AdamW state for parameters that have none yet (a fresh optimizer about to be loaded), the moments
    in the optimizer's ``state_dtype`` when it has one (``genoctx.train.optim.AdamW``: bf16), else the parameter's
    dtype (``torch.optim.AdamW``); ``dcp.load`` casts a checkpoint's moments of another dtype into them.
    """
    modules = dict(model.named_modules())
    tied = model.lm_head.weight is model.embed_tokens.weight
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}

    def present(name: str, t: torch.Tensor, p) -> torch.Tensor:
        if p is not None and is_expert_parameter(p) and dims is not None and dims.ep > 1:
            return _expert_dtensor(t, modules[name.rsplit(".", 1)[0]], dims)
        return t

    for name, t in model.state_dict(keep_vars=True).items():
        if tied and name == TIED_HEAD:
            continue
        p = params.get(name)
        if (
            p is None and dims is not None and dims.ep > 1 and _ep_block(modules, name) is not None
        ):  # an EP-sliced fp8 holder: Shard(0) over ep
            out[f"model.{name}"] = _holder_dtensor(t.detach(), _ep_block(modules, name)[1], dims)
            continue
        if p is None:  # a buffer (router biases)
            value = t.detach()
        else:  # an FSDP parameter is its DTensor; a replicated one shares its memory through .data
            value = p if hasattr(p, "to_local") else p.data
        out[f"model.{name}"] = present(name, value, p)
    if optimizer is not None:
        names = {id(p): n for n, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    for k in ADAM_KEYS:
                        st[k] = torch.zeros_like(p, dtype=getattr(optimizer, "state_dtype", None))
                name = names[id(p)]
                out[f"optim.{name}.step"] = st["step"]
                for k in ADAM_KEYS:
                    out[f"optim.{name}.{k}"] = present(name, st[k], p)
    return out
