"""Context parallelism (CP) and data parallelism (DP) applied from outside the model (torchtitan style).

One window of ``L`` tokens is split into ``cp`` contiguous slices of ``L / cp`` tokens; rank ``r`` of the CP
group runs the unchanged ``HybridLM`` on slice ``r``. ``apply_cp(model, group)`` registers a forward
pre-hook on every mixing layer that REPLACES the layer's incoming cache (None at the start of a slice) by
the cache the earlier ranks' slices would have left (DESIGN.md, the chunk contract):

- KDA (Kimi Linear; fla ``fla/ops/cp``): the state is linear in the initial state,
  ``S_end = M_r S_init + L_r`` per head (``M_r`` [K, K], ``L_r`` [K, V], fp32). Each rank runs
  ``chunk_kda`` once with values ``[v | 0]`` (width V + K) and initial state ``[0 | I]``: the final state is
  ``[L_r | M_r]``. The ``[L | M]`` of all ranks are all-gathered (autograd-aware collective, so gradients
  reach the earlier ranks' inputs) and folded, ``S <- M_j S + L_j`` for ``j < r``. The short-convolution
  tail (the last ``conv_size - 1`` pre-convolution q|k|v inputs) of rank ``r - 1`` is all-gathered first.
- DSA (DeepSeek-V3.2; Megatron's CP for DSA is all-gather only): the keys, values and indexer keys of the
  slice are all-gathered; the earlier ranks' part becomes the ``DSACache``; each rank scores only its own
  queries, so the indexer work is split (unevenly: the last rank scores the most keys, recorded per rank in
  ``mixer.stats["keys_scored"]``).
- MoE / MLP: nothing (position-wise).

Every rank uses every gathered tensor (unused parts are multiplied by 0), so every rank runs the same
collectives in the same order in backward; a rank whose own use of the gathered data is empty (rank 0) still
takes part in the gradient reduce-scatter. Cost: the KDA core runs twice per layer (once for ``[L | M]``,
once in the layer) and the DSA k/v/indexer projections twice.

Loss and gradients (DESIGN.md): each rank back-propagates ``local loss sum / global scored count``
(the count all-reduced over CP x DP first, clamped at 1), plus its auxiliary losses weighted by its share of
the global queries; gradients are then summed over CP x DP. The sum of the ranks' objectives is exactly the
one-process objective over the whole batch, so CP=2 equals CP=1 and DP=2 equals one process with both
windows batched, to fp32 rounding. A rank whose slice is all N adds 0 to the sum and the count: no NaN.
(The optional MoE sequence-wise balance loss, ``moe_aux_loss_coef > 0``, is a product of per-sequence means
and is only approximated under CP.)

Process groups come from Megatron-core (``initialize_model_parallel(context_parallel_size=cp)``), on gloo
(CPU) or NCCL (CUDA); ``ParallelDims`` answers which dims are on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..model.config import DSA
from ..model.dsa import DSACache
from ..model.kda import KDACache, chunk_kda
from ..model.moe import MoE


@dataclass
class ParallelDims:
    """Which parallel dims are on, and the groups that serve them.

    Attributes:
        cp, dp: context- and data-parallel sizes (``cp * dp`` = world size; tensor/pipeline parallel = 1).
        cp_rank, dp_rank: this process's rank inside its CP group and its DP group.
        cp_group: the CP group (None when ``cp == 1``).
        dp_cp_group: the group over which loss, gradients and MoE loads are reduced (all CP x DP ranks).
    """

    cp: int = 1
    dp: int = 1
    cp_rank: int = 0
    dp_rank: int = 0
    cp_group: object | None = None
    dp_cp_group: object | None = None

    @property
    def world(self) -> int:
        return self.cp * self.dp

    @property
    def is_distributed(self) -> bool:
        return self.world > 1


def init_parallel(cp: int) -> ParallelDims:
    """Megatron-core process groups for ``cp`` x ``world / cp`` on an initialised default process group.

    Args:
        cp: context-parallel size; must divide the world size.

    Returns:
        ``ParallelDims`` whose groups come from ``megatron.core.parallel_state``.

    Raises:
        ValueError: torch.distributed is not initialised, or ``cp`` does not divide the world size.
    """
    if not dist.is_initialized():
        raise ValueError("init_parallel needs torch.distributed initialised (gloo on CPU, nccl on CUDA)")
    world = dist.get_world_size()
    if cp < 1 or world % cp:
        raise ValueError(f"--cp {cp} must divide the number of workers ({world})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on CPU
        from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=cp)
    return ParallelDims(
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_group=ps.get_context_parallel_group() if cp > 1 else None,
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


def destroy_parallel() -> None:
    """Tear down Megatron-core's groups (the default process group is left to its owner)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def shard_sequence(x: Tensor, cp: int, cp_rank: int) -> Tensor:
    """Rank ``cp_rank``'s contiguous slice of ``x`` ``[B, L, ...]`` along dim 1: ``[B, L / cp, ...]``.

    Raises:
        ValueError: ``L`` is not a multiple of ``cp``.
    """
    L = x.shape[1]
    if L % cp:
        raise ValueError(f"context parallelism: sequence length {L} is not a multiple of cp={cp}")
    n = L // cp
    return x[:, cp_rank * n : (cp_rank + 1) * n]


def _all_gather(x: Tensor, group) -> list[Tensor]:
    """Autograd-aware all-gather: backward sums each rank's gradient contributions back to its owner."""
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return list(all_gather(x.contiguous(), group=group))


def kda_cp_cache(mixer, x: Tensor, group) -> KDACache:
    """The ``KDACache`` that the slices of the earlier CP ranks leave for this rank's slice.

    Args:
        mixer: a ``KimiDeltaAttention`` layer.
        x: ``[B, T, d_model]`` this rank's layer input (T equal on all ranks, ``T >= conv_size - 1``).
        group: the CP process group.

    Returns:
        ``KDACache(state [B, H, K, V] fp32, conv_state [B, conv_size - 1, 3 H K])``, differentiable w.r.t. every
        rank's ``x`` and the layer's parameters (through the autograd-aware all-gathers).

    Raises:
        ValueError: ``T < conv_size - 1``.
    """
    r = dist.get_rank(group)
    B, T, _ = x.shape
    c = mixer.conv_size - 1
    if T < c:
        raise ValueError(f"context parallelism: slice of {T} tokens is shorter than the KDA conv tail ({c})")
    xt = x[:, T - c :]
    tail = torch.cat([mixer.q_proj(xt), mixer.k_proj(xt), mixer.v_proj(xt)], dim=-1)  # [B, c, 3 H K]
    tails = _all_gather(tail, group)
    conv_state = tails[r - 1] if r > 0 else tails[0] * 0.0
    q, k, v, g, beta, _ = mixer.project(x, conv_state)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    v_ext = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)  # [v | 0]
    s0 = torch.cat([q.new_zeros(B, H, K, V, dtype=ct), torch.eye(K, dtype=ct, device=q.device).expand(B, H, K, K)], -1)
    _, LM = chunk_kda(q, k, v_ext, g, beta, initial_state=s0, chunk_size=mixer.chunk_size)  # [B, H, K, V + K]
    parts = _all_gather(LM, group)
    S = LM.new_zeros(B, H, K, V)
    for j, part in enumerate(parts):
        L_j, M_j = part.split([V, K], dim=-1)
        m = 1.0 if j < r else 0.0  # same ops on every rank; later ranks' parts enter with weight 0
        S = m * (M_j @ S + L_j) + (1.0 - m) * S
    return KDACache(state=S, conv_state=conv_state)


def dsa_cp_cache(mixer, x: Tensor, group) -> tuple[DSACache, Tensor]:
    """The ``DSACache`` of the earlier CP ranks' positions, and a zero scalar that ties this rank to the gather.

    Args:
        mixer: a ``DeepSeekSparseAttention`` layer.
        x: ``[B, T, d_model]`` this rank's layer input (T equal on all ranks).
        group: the CP process group.

    Returns:
        ``(DSACache(k [B, r T, KVH, Dh], v, index_k [B, r T, d_I]), zero)``: ``zero`` (a 0-dim tensor equal
        to 0) must be added to the layer input so that every rank's backward runs the gather's collective.
    """
    r = dist.get_rank(group)
    B, T, _ = x.shape
    KVH, Dh = mixer.n_kv_heads, mixer.head_dim
    k = mixer.k_proj(x)
    v = mixer.v_proj(x)
    ik = mixer.indexer_inputs(x)[2]  # [B, T, d_I] (of x.detach(): the indexer learns only from its KL)
    dI = ik.shape[-1]
    packed = torch.cat([k, v, ik.to(k.dtype)], dim=-1)  # [B, T, 2 KVH Dh + d_I]
    parts = _all_gather(packed, group)
    earlier = torch.cat(parts[:r], dim=1) if r > 0 else packed[:, :0]
    ke, ve, ie = earlier.split([KVH * Dh, KVH * Dh, dI], dim=-1)
    zero = torch.stack(parts).sum() * 0.0
    cache = DSACache(ke.reshape(B, -1, KVH, Dh), ve.reshape(B, -1, KVH, Dh), ie.to(ik.dtype))
    return cache, zero


def _cp_pre_hook(group, layer_type):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x = args[0] if args else kwargs["x"]
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        if cache is not None:
            raise ValueError("apply_cp: a CP slice must start without a cache (chunked CP is not supported)")
        if layer_type == DSA:
            cache, zero = dsa_cp_cache(module, x, group)
            x = x + zero.to(x.dtype)
        else:
            cache = kda_cp_cache(module, x, group)
        return (x, cache), {}

    return hook


def apply_cp(model: nn.Module, cp_group) -> list:
    """Make ``model`` (a ``HybridLM``) run one CP slice of a window per rank of ``cp_group``.

    Registers a forward pre-hook (``with_kwargs=True``) on each block's mixer that replaces its incoming
    cache with the one built from the other ranks (``kda_cp_cache``, ``dsa_cp_cache``). The model's
    forward is then called on this rank's slice only (``shard_sequence``), with no cache.

    Returns:
        The hook handles (``h.remove()`` undoes ``apply_cp``).
    """
    handles = []
    for block in model.blocks:
        hook = _cp_pre_hook(cp_group, block.layer_type)
        handles.append(block.mixer.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """A copy of ``x`` summed over ``group`` (no autograd); ``x`` itself is returned when group is None."""
    if group is None:
        return x
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


def all_reduce_grads(model: nn.Module, group) -> None:
    """Sum every parameter's gradient over ``group`` in one flat buffer (missing gradients count as 0).

    With each rank's objective ``local loss sum / global count`` the sum is the gradient of the global
    mean loss: no further division.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off : off + n].view_as(p.grad))
        off += n


def all_reduce_moe_loads(model: nn.Module, group) -> None:
    """Sum the MoE ``load_counts`` over ``group`` (before ``update_router_biases``), so that every rank moves
    the router biases by the global batch's loads (DeepSeek-V3 aux-loss-free balancing)."""
    for m in model.modules():
        if isinstance(m, MoE):
            dist.all_reduce(m.load_counts, op=dist.ReduceOp.SUM, group=group)
