"""FSDP2, activation checkpointing and gradient reduction, applied from outside the model (torchtitan style).

``apply_parallel(model, dims)`` is the one place where parallelism is applied, in this order:

1. expert parallel (``genoctx.parallel.experts.apply_ep``): every MoE keeps its rank's block of routed experts;
2. context parallel (``genoctx.parallel.context.apply_cp``): the mixing layers take their pieces' caches;
3. ``torch.compile`` of each decoder layer's forward (``genoctx.parallel.compile.apply_compile``, optional,
   ``train.compile``; not with EP or CP yet);
4. activation checkpointing (``apply_ac``, optional): each decoder layer recomputed in backward (the checkpoint
   wraps the compiled forward); with ``offload_activations`` the input each layer keeps lives in host memory
   (``genoctx.parallel.offload``);
5. FSDP2 (``apply_fsdp``, when ``dp_shard > 1`` or ``cp > 1``): ``fully_shard`` per decoder layer, then the root.

The optimizer is built afterwards, on the sharded parameters (DTensors): its state is sharded as they are.

Sharding (``genoctx.parallel.layout``): dense parameters are sharded over ``ep x dp_shard x cp`` (every rank of a
replica sees different tokens) and replicated over ``dp_replicate`` (HSDP); each rank's block of routed experts
(its own FSDP group, wrapped first) over ``dp_shard x cp``. Every FSDP module divides gradients by 1
(``set_gradient_divide_factor(1.0)``): each rank back-propagates ``local loss sum / global token count``
(``genoctx.train.loop.forward_backward``), so the reduction must be a sum, never a mean.

Mixed precision (``MixedPrecisionPolicy``): with ``param_dtype=bf16`` the all-gathered parameters are bf16, the
sharded masters, gradients' reduction (``reduce_dtype``) and optimizer state fp32. The fp32 islands (KDA decay gate,
short convolution and output norm, MoE router, mHC mixing) are wrapped with fp32 parameters, so they compute exactly
as on one device (the KDA mixer as a whole: its projections' matmuls still run in bf16 under autocast), each island
module in an FSDP group of its own (``_island_groups``: a group is all-gathered at each call of one of its modules, so
the KDA mixer's ~140M parameters per layer are gathered once in forward and once in backward).
No policy casts forward inputs (``cast_forward_inputs=False``; FSDP's default casts every floating tensor handed to
a wrapped module, dataclass caches included, to ``param_dtype``: the carried KDA state and pooled indexer keys were
rounded to bf16 at each layer and chunk boundary, the residual streams were bf16 between layers, while the islands
still computed, and recorded, fp32). bf16 parameters therefore need bf16 autocast around the forward (as training
and eval run them: autocast casts each matmul's inputs); ``_dtype_boundaries`` makes the two casts that remain (the
embedding's output to fp32, the routed experts' rows to bf16). The streams and caches are then one process's
computed from bf16-rounded parameters (``tests/parallel/test_mesh.py``,
``test_fsdp_bf16_params_carry_fp32_streams_and_caches``).

Without FSDP (``dp_shard == cp == 1``: replicas and EP only) parameters are replicated and ``reduce_gradients``
all-reduces (sums) them: dense ones over the whole mesh, routed experts over the ranks holding the same block
(``dims.expert_group``). A model with CP applied but no FSDP (``apply_cp`` alone, as the CP tests run it) is
all-reduced the same way.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..model.host import read
from ..model.kda import KimiDeltaAttention
from ..model.moe import MoE
from . import collectives as coll
from .mesh import ParallelDims

ISLAND_DTYPE = torch.float32


def is_expert_parameter(p: nn.Parameter) -> bool:
    """True for a routed expert's parameter under expert parallelism (marked by ``apply_ep``)."""
    return bool(getattr(p, "_genoctx_expert", False))


RECORDS = ("aux_loss", "stats")  # what a forward records on a module besides its output (and MoE's load_counts)


@contextlib.contextmanager
def keep_forward_records(layer: nn.Module):
    """While a layer's forward is recomputed in backward: its modules' ``aux_loss`` and ``stats`` and the MoE
    ``load_counts`` are restored on exit to what the first forward left. Without it the recomputation would count
    the router loads twice and replace ``aux_loss`` with a tensor that keeps the recomputation's graph (the
    indexer branch, under CP the gathered window) alive after the layer's backward."""
    kept = []
    for m in layer.modules():
        attrs = {k: m.__dict__[k] for k in RECORDS if k in m.__dict__}
        counts = m._buffers.get("load_counts")
        kept.append((m, attrs, None if counts is None else counts.clone()))
    try:
        yield
    finally:
        for m, attrs, counts in kept:
            m.__dict__.update(attrs)
            if counts is not None:
                m._buffers["load_counts"].copy_(counts)


def apply_ac(model: nn.Module, offload: bool = False) -> int:
    """Recompute each decoder layer in backward (non-reentrant ``torch.utils.checkpoint``). Returns layers wrapped.

    The layer's ``forward`` is overridden on the instance (parameter names do not change). Memory per layer falls to
    its input (``[B, T, hc_mult, D]`` residual streams); the cost is one more forward of each layer. Collectives
    inside a layer (CP gathers, EP dispatch) run again in backward, in the same order on every rank. The recomputed
    forward leaves the first forward's records (``keep_forward_records``): router loads, ``aux_loss``, ``stats``.

    ``offload`` (``train.offload_activations``): the layer input the checkpoint keeps is a copy in host memory
    (``genoctx.parallel.offload``): the first forward runs on the device input, which is then freed as soon as the
    next layer has used it; the recompute runs on a copy of the host tensor back on the device. Per layer call with
    grad: one copy to host and one back, ``B x T x hc_mult x D x element size`` bytes each (``OffloadStats``).
    Exact: the layer computes on the same values. The layer's first positional argument must be its input tensor
    (``DecoderLayer.forward(x, cache, selection)``).
    """
    from torch.utils.checkpoint import checkpoint

    from .offload import device_anchor, to_device, to_host

    for layer in model.layers:
        fwd = layer.forward

        def recomputed(*args, _fwd=fwd, _layer=layer, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)

            def contexts():
                return contextlib.nullcontext(), keep_forward_records(_layer)

            if not offload:
                return checkpoint(_fwd, *args, use_reentrant=False, context_fn=contexts, **kwargs)
            copy = to_host(args[0])
            first = [args[0]]  # the device input, for the first forward only (then dropped: nothing else keeps it)

            def run(host, _anchor, *rest, **kw):
                x = first.pop() if first else to_device(copy, host)  # the first forward, else the recompute
                return _fwd(x, *rest, **kw)

            anchor = device_anchor(copy.device)
            rest, args = args[1:], None
            return checkpoint(run, copy.tensor, anchor, *rest, use_reentrant=False, context_fn=contexts, **kwargs)

        layer.forward = recomputed
    return len(model.layers)


def _islands(layer: nn.Module) -> list[nn.Module]:
    """The modules of one decoder layer whose parameters stay fp32 under a bf16 ``MixedPrecisionPolicy``: the KDA
    mixer (decay gate, short convolution, gated norm are fp32 islands), the MoE router, the mHC mixings."""
    mods = []
    attn = layer.self_attn
    if isinstance(attn, KimiDeltaAttention):  # its whole mixer: the decay gate, conv and gated norm read their
        mods.append(attn)  # weights inside its forward (autocast still runs its matmuls in bf16)
    if isinstance(layer.mlp, MoE):
        mods.append(layer.mlp.gate)
    mods += [layer.attn_hc, layer.ffn_hc]
    return mods


def _island_groups(layer: nn.Module) -> list[list[nn.Module]]:
    """``_islands(layer)`` as FSDP2 groups: one module each (``[[self_attn], [mlp.gate], [attn_hc], [ffn_hc]]``).

    FSDP2 all-gathers a group at every call of one of its modules and reshards it after (``reshard_after_forward``),
    so a module's parameters travel as often as the group's modules are called, not as often as they are used:

    - the KDA mixer (``self_attn``, the big one: ~140M parameters per GLM-5.3-Flash layer, fp32) is called once per
      layer forward: gathered once in forward, once in backward (none in an activation-checkpointing recompute);
    - the router (``mlp.gate``, ``E x D``) is called once per ``moe_chunk_tokens`` chunk: gathered per chunk in
      forward and again per chunk in backward (each chunk is checkpointed);
    - ``attn_hc`` / ``ffn_hc``: ``pre`` and ``post`` are registered forward methods: two gathers each per forward
      and two per backward (``fn`` ``(2 + n) n x n D`` parameters, ``base``, ``scale``: small).

    Sharing a group would gather a module's parameters at the other modules' calls too (one group of all four moved
    the KDA mixer at each of the four mHC calls). A group whose modules do not all run ``forward`` (the mHC
    modules are only called through ``pre``/``post``) is also left incomplete after the forward: the root then
    completes it and registers its pre-backward on the model's output, so it is all-gathered again at the start of
    backward and stays unsharded until its layer's backward (every layer's at once). Groups of one module avoid
    both.
    """
    return [[m] for m in _islands(layer)]


def _dtype_boundaries(model: nn.Module, param_dtype: torch.dtype) -> list:
    """The two casts a bf16 ``MixedPrecisionPolicy`` makes instead of FSDP's input casts (module docstring), as
    forward hooks; returns their handles.

    - ``embed_tokens``' output to fp32: the residual streams start from it, and one process (fp32 parameters under
      bf16 autocast) carries them in fp32 from layer to layer;
    - each ``mlp.experts``' hidden states (its first argument, not the fp32 routing weights) to ``param_dtype``: the
      value autocast gives the experts' first matmul anyway, so the dispatched rows (and under EP the all-to-all)
      are ``param_dtype`` as planned (``genoctx.plan``: ``a`` bytes per value).

    Everything else keeps the dtype its producer gave it: the carried KDA state and pooled indexer keys fp32, the DSA
    latents autocast's (bf16: the latent norm's bf16 weight times its bf16 output)."""

    def streams(module, args, out):
        return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out

    def rows(module, args):
        x = args[0]
        return (x.to(param_dtype), *args[1:]) if x.is_floating_point() else None

    handles = [model.embed_tokens.register_forward_hook(streams)]
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            handles.append(layer.mlp.experts.register_forward_pre_hook(rows))
    return handles


def expert_placement(experts: nn.Module, dims: ParallelDims):
    """FSDP2's ``shard_placement_fn`` for a rank's block of routed experts: ``Shard(0)`` (whole experts per shard),
    or, with folded EP where the block's ``n_local_experts`` do not split evenly over the ``efsdp`` ranks (288 / 32
    = 9 experts over 2), ``Shard(1)`` (each expert's rows split; no padded expert), as torchtitan shards experts.
    None (FSDP2's default, ``Shard(0)``) otherwise."""
    from torch.distributed.tensor import Shard

    n = getattr(experts, "n_local_experts", None)
    shards = dims.layout.expert_shard
    if not dims.layout.ep_folded or n is None or n % shards == 0:
        return None
    return lambda p: Shard(1) if p.dim() > 1 and p.shape[1] % shards == 0 else Shard(0)


def apply_fsdp(
    model: nn.Module,
    dims: ParallelDims,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    offload_optimizer: bool = False,
) -> list[nn.Module]:
    """``fully_shard`` the model over ``dims.dense_mesh`` (routed experts over ``dims.expert_mesh``).

    Args:
        model: a ``HybridLM`` (after ``apply_ep``/``apply_cp``/``apply_ac``), parameters still full tensors.
        dims: from ``init_parallel`` with ``dp_shard > 1``, ``cp > 1`` or ``fsdp_one``.
        param_dtype: compute dtype of the all-gathered parameters (``torch.bfloat16`` on GPU; None keeps fp32). With
            bf16 the forward must run under bf16 autocast (inputs are not cast: module docstring).
        reduce_dtype: dtype of the gradient reduce-scatter/all-reduce (fp32).
        offload_optimizer: keep sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.

    Returns:
        The FSDP modules, innermost first (each with gradient divide factor 1: reductions are sums).

    Raises:
        ValueError: ``dims`` has no FSDP mesh (``dp_shard == cp == 1`` without ``fsdp_one``).
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if not dims.fsdp or dims.dense_mesh is None:
        raise ValueError("apply_fsdp needs dp_shard > 1, cp > 1 or fsdp_one (init_parallel(dp_shard=..., cp=..., "
                         "fsdp_one=...))")  # fmt: skip
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    mp_island = MixedPrecisionPolicy(param_dtype=ISLAND_DTYPE if param_dtype is not None else None,
                                     reduce_dtype=reduce_dtype, cast_forward_inputs=False)  # fmt: skip
    # pinned on CUDA: one block per parameter shard and per gradient, each rounded up to a power of two by torch's
    # caching host allocator (counted by genoctx.plan.memory.pinned_block_bytes)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_optimizer else OffloadPolicy()
    experts = {n for n, p in model.named_parameters() if is_expert_parameter(p)}
    wrapped = []
    for layer in model.layers:
        inner = layer
        if isinstance(inner.mlp, MoE) and any(is_expert_parameter(p) for p in inner.mlp.experts.parameters()):
            wrapped.append(fully_shard(inner.mlp.experts, mesh=dims.expert_mesh, mp_policy=mp, offload_policy=offload,
                                       shard_placement_fn=expert_placement(inner.mlp.experts, dims)))  # fmt: skip
        if param_dtype is not None:  # the layer's fp32 island modules, in groups of their own (_island_groups)
            for group in _island_groups(inner):
                fully_shard(group, mesh=dims.dense_mesh, mp_policy=mp_island, offload_policy=offload)
                wrapped.append(group[0])
            for hc in (inner.attn_hc, inner.ffn_hc):  # the layer calls their pre/post, never forward
                register_fsdp_forward_method(hc, "pre")
                register_fsdp_forward_method(hc, "post")
        wrapped.append(fully_shard(layer, mesh=dims.dense_mesh, mp_policy=mp, offload_policy=offload))
    wrapped.append(fully_shard(model, mesh=dims.dense_mesh, mp_policy=mp, offload_policy=offload))
    if param_dtype is not None:
        _dtype_boundaries(model, param_dtype)
    for name, p in model.named_parameters():  # fully_shard made new (DTensor) parameters: mark them again
        if name in experts:
            p._genoctx_expert = True
    for m in wrapped:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM; NCCL zero-copy wants SUM)
    _register_methods(model)
    return wrapped


def _register_methods(model: nn.Module) -> None:
    """Let ``model.hidden`` (the chunked-head path) unshard the root's parameters as ``forward`` does."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if hasattr(model, "hidden"):
        register_fsdp_forward_method(model, "hidden")


def all_reduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat buffer (a missing gradient counts as 0)."""
    if group is None or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    coll.all_reduce(flat, group=group)
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off : off + n].view_as(p.grad))
        off += n


def reduce_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """Sum gradients over the ranks that hold each parameter, after backward.

    Under FSDP this already happened in backward (reduce-scatter and replica all-reduce, divide factor 1). Without
    it: dense parameters are all-reduced over the whole mesh (``dims.dp_cp_group``), routed experts under EP over
    ``dims.expert_group`` (their owner already holds every EP rank's tokens' contribution).
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or not dims.is_distributed:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    all_reduce_grads([p for p in params if not is_expert_parameter(p)], dims.dp_cp_group)
    all_reduce_grads([p for p in params if is_expert_parameter(p)], dims.expert_group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copies(grad: torch.Tensor, expert: bool, dims: ParallelDims) -> float:
    """Ranks holding the same piece of ``grad``: the world over the shards of its placements (FSDP), and over the EP
    blocks for a routed expert."""
    shards = 1
    if hasattr(grad, "placements"):
        shards = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if pl.is_shard())
    return dims.world / (shards * (dims.ep if expert else 1))


def grad_norm(model: nn.Module, dims: ParallelDims | None) -> torch.Tensor:
    """The global L2 norm of the gradients (fp64 scalar), whatever the sharding.

    Each rank sums the squares of the gradient pieces it holds, weighted by 1 / (ranks holding the same piece,
    ``_copies``: under FSDP a dense piece has ``world / dense_shard`` copies, a routed-expert piece
    ``world / (ep x expert_shard)``; replicated, ``world`` and ``world / ep``); one all-reduce over the mesh adds
    them up, on the mesh's device: under optimizer offload the gradients are CPU DTensors, and NCCL reduces CUDA
    tensors only (``genoctx.parallel.collectives.to_device_of``). The result is on the mesh's device.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if dims is None or not dims.is_distributed:
        sq = sum((p.grad.detach().double().pow(2).sum() for p in params), torch.zeros((), dtype=torch.float64))
        return sq.sqrt()
    sq = torch.zeros((), dtype=torch.float64, device=params[0].grad.device if params else "cpu")
    for p in params:
        sq = sq + _local(p.grad.detach()).double().pow(2).sum() / _copies(p.grad, is_expert_parameter(p), dims)
    sq = coll.to_device_of(sq.to(torch.float64), dims.dp_cp_group, dims.mesh)
    coll.all_reduce(sq, group=dims.dp_cp_group, mesh=dims.mesh)
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, dims: ParallelDims | None) -> float:
    """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule) with
    the global norm of ``grad_norm``. Returns the norm before clipping (float).

    One host read (the norm, fp64; ``genoctx.model.host.read``): the coefficient is computed from it on the host in
    fp64, as ``float(max_norm / (norm + 1e-6))`` of the tensor gives.
    """
    norm = read(grad_norm(model, dims), label="clip.norm")
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm if math.isfinite(norm) else float("nan")


def apply_parallel(
    model: nn.Module,
    dims: ParallelDims,
    *,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    offload_optimizer: bool = False,
    cp_chunk_tokens: int | None = None,
    compile: bool = False,
    offload_activations: bool = False,
) -> list:
    """Apply every parallel dimension of ``dims`` to ``model`` in the documented order (module docstring).
    ``cp_chunk_tokens``: each CP piece streamed through a mixing layer in chunks of this many tokens
    (``genoctx.parallel.context.CPLayout``; evaluation); None = one call per piece. ``compile``: ``torch.compile``
    each decoder layer (``genoctx.parallel.compile``). ``offload_activations``: the checkpointed layers' inputs in host
    memory (``apply_ac(offload=True)``, ``genoctx.parallel.offload``).

    Returns the handles of ``apply_cp``/``apply_ep`` (their ``.remove()`` restores the class forwards).

    Raises:
        ValueError: ``compile`` with ``dims.ep > 1`` or ``dims.cp > 1`` (not supported yet);
            ``offload_activations`` without ``activation_checkpointing``.
    """
    from .context import apply_cp

    if offload_activations and not activation_checkpointing:
        raise ValueError("offload_activations offloads the checkpointed layers' inputs: it needs "
                         "activation_checkpointing=True")  # fmt: skip
    if compile and (dims.ep > 1 or dims.cp > 1):
        raise ValueError(f"compile is not supported with ep={dims.ep}, cp={dims.cp} yet")
    handles = []
    if dims.ep > 1:
        from .experts import apply_ep

        handles += apply_ep(model, dims.ep_group, dims.ep, dims.ep_rank)
    if dims.cp > 1:
        handles += apply_cp(model, dims.cp_group, dims.cp_layout, cp_chunk_tokens)
    if compile:
        from .compile import apply_compile

        apply_compile(model)
    if activation_checkpointing:
        apply_ac(model, offload=offload_activations)
    if dims.fsdp:
        apply_fsdp(model, dims, param_dtype=param_dtype, offload_optimizer=offload_optimizer)
    return handles
