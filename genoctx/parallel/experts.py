"""Expert parallelism (EP): the routed experts of every MoE layer split over the ranks of an EP group.

``apply_ep(model, ep_group, ep_size, ep_rank)`` keeps on rank ``r`` only the contiguous block of routed experts
``[r E / ep, (r + 1) E / ep)`` (``E = n_routed_experts``) and overrides ``forward`` on each ``MoE`` and its
``Experts`` instance (torchtitan style: the model is written for one device, parallelism is applied from outside).
The router and the shared expert stay local (replicated, data parallel); only the routed experts' rows travel.
Sources: DeepSeek-V3 (arXiv:2412.19437, section 3.2: EP with all-to-all dispatch and combine), Megatron-core's
``MoEAlltoAllTokenDispatcher`` (counts exchanged first, then ``all_to_all_single`` with split sizes, permutation
by expert on the receiver) and torchtitan's ``ExpertParallel`` (EP applied from outside the model).

Algorithm of one MoE forward on a rank with ``N`` tokens (``k = num_experts_per_tok``, ``P = ep``):

1. Local part, in chunks of ``moe_chunk_tokens`` (checkpointed as ``MoE`` does when ``recompute`` and grad are
   on): router (global expert ids [N, k] and weights [N, k] fp32), shared expert, loads (``MoE._local``).
2. Counts: every rank all-gathers the [E] int64 counts of its (token, slot) rows per global expert, so every rank
   knows the whole matrix ``counts[s, e]`` and ``c[s, d]``, the rows source ``s`` sends to destination ``d``
   (the sum of ``counts[s, e]`` over ``d``'s experts). Rows are sorted by expert (stable), so the rows for ``d``
   are one contiguous block of the sender's sorted rows, expert-major inside. The gathered counts are read on the
   host once (``genoctx.model.host.read``): the one host sync of a MoE forward under EP, which
   ``all_to_all_single``'s host split sizes need; every round's sizes, forward and backward, follow from them on the
   host, and the grouping permutations reach the device by non-blocking copies (``to_device``).
3. Rounds (``round_schedule``). With ``cap = moe_chunk_tokens * k`` rows and ``M`` the most rows any rank sends
   or receives (the largest row or column sum of ``c``), there are ``R = ceil(M / (cap - P + 1))`` rounds
   (``cap >= P`` is required) and round ``r`` carries, of every pair, the rows ``[floor(r c / R),
   floor((r + 1) c / R))`` of its block. Every row goes exactly once (the bounds telescope from 0 to ``c``), and
   a destination receives at most ``cap`` rows per round:
   ``Σ_s (floor((r + 1) c_s / R) - floor(r c_s / R)) <= Σ_s ceil(c_s / R) <= Σ_s c_s / R + P (R - 1) / R
   <= cap - P + 1 + P - P / R < cap + 1``; a source likewise sends at most ``cap`` rows per round. ``R`` depends
   only on the all-gathered counts, so every rank runs the same ``R`` rounds (a rank with nothing to send or
   receive exchanges empty blocks). Balanced routing gives ``R`` about ``N / moe_chunk_tokens`` (as many rounds
   as ``MoE`` has chunks); every row of every rank routed to one rank's experts gives about ``P`` times more
   rounds of the same size. No row is ever dropped (no capacity factor).
4. Each round: ``all_to_all_single`` of the rows' hidden states to their owners; the owner groups the received
   rows by local expert (their per-(source, expert) counts follow from ``counts`` and the round bounds: no ids
   travel), runs each expert (``expert_mlp``), and sends the outputs back with the reverse ``all_to_all_single``;
   the sender adds ``weight · output`` into a [N, D] accumulator in the weights' dtype (fp32), as ``Experts``
   does (``train.deterministic``: into its slot of an [N k, D] buffer summed in slot order at the end,
   ``genoctx.model.moe.combine_slots``; the input gradient likewise). Each round's buffers are freed before the
   next, so the memory that routing can move is at most ``cap`` rows (hidden states, expert activations) per round
   on every rank, whatever the routing.

Autograd: steps 2-4 are one ``torch.autograd.Function`` (``_EPExperts``) that saves only its inputs (the hidden
states x [N, D], the weights [N, k], the local expert weights) and the sorted row order, never a received row or
an expert activation (those depend on routing: a rank may receive ``P N k`` rows). Its backward runs the same
rounds in the same order on every rank: the sender sends each row's hidden state and its output gradient
``weight · dL/dy`` (one ``all_to_all_single``, packed as bytes), the owner recomputes the expert with grad on
those rows, accumulates the local experts' weight gradients and sends back the input gradient and the expert
output (the reverse ``all_to_all_single``), from which the sender forms ``dL/dweight = <dL/dy, output>``. So the
exchange is re-run in backward as part of the Function's own backward, never inside a checkpoint recomputation;
the backward of every MoE layer is one autograd node, so ranks cannot reorder its collectives. The expert
recomputation runs under the autocast state of the forward.

LoRA (``genoctx.model.lora``, issue 44): the experts' adapters are stored expert-first (``gate_up_proj_lora_A``
[E, r, D], ``gate_up_proj_lora_B`` [E, 2I, r], ``down_proj_lora_A`` [E, r, I], ``down_proj_lora_B`` [E, D, r]) so that
``apply_ep`` splits them on dim 0 with the base weights. They are inputs of ``_EPExperts`` like the base weights: the
owner runs ``expert_mlp`` with expert ``e``'s slices (the one-process math of ``Experts.forward``) and its backward
accumulates their gradients as it does the weights'. Frozen tensors (``requires_grad`` False, e.g.
``train.trainable: lora`` or a list without ``experts``) get no accumulator and their weight-gradient matmuls never
run: the recomputed expert's autograd asks only for what trains (plus the rows' input gradient).

``MoE.recompute`` only decides whether step 1 is checkpointed: under EP the expert activations are always recomputed
(keeping them would make the receiving rank's memory follow the routing). Cost, per (token, slot) row: forward sends
D values each way, backward 2 D each way (the hidden state is re-sent instead of kept, the output is returned for the
weight's gradient), and each expert runs its forward twice (forward, recomputation) and its backward once, as with
checkpointing.

Gradients: a local expert's gradient already sums the contributions of every EP rank's tokens; reduce it only
over the ranks that hold the same block (``expert_parameters`` lists these parameters, each marked
``_genoctx_expert = True``). The router and shared-expert gradients are local, reduced over all data-parallel
ranks as usual. ``MoE.stats["tokens_per_expert"]`` stays the [E] global count of this rank's own rows, so
``load_counts`` / ``update_bias`` balancing is unchanged (all-reduce the loads as before).

Every rank of the EP group must call the MoE forward (and, when one does, its backward) the same number of
times, with the same ``moe_chunk_tokens``; the number of tokens may differ per rank, zero included.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..model.fp8 import SUFFIX, FP8View, held
from ..model.host import cpu_values, read, to_device
from ..model.moe import Experts, MoE, combine_path, expert_mlp
from . import collectives as coll


def n_rounds(pair: Tensor, cap: int) -> int:
    """Rounds needed so that no rank sends or receives more than ``cap`` rows in a round (module docstring, 3).

    Args:
        pair: [P, P] int64 on the CPU, ``pair[s, d]`` rows source ``s`` sends to destination ``d`` (>= 0).
        cap: most rows a rank may receive (and send) in one round; must be >= P.

    Returns:
        ``ceil(M / (cap - P + 1))`` with ``M`` the largest row or column sum of ``pair`` (0 when no rows).

    Raises:
        ValueError: ``cap < P``, a non-square or negative ``pair``.
    """
    P = pair.shape[0]
    if pair.dim() != 2 or pair.shape[1] != P:
        raise ValueError(f"expert parallelism: the count matrix must be [ep, ep], got {list(pair.shape)}")
    rows = cpu_values(pair)  # host counts (read once per forward by ``_plan``): no device read here
    if any(c < 0 for row in rows for c in row):
        raise ValueError("expert parallelism: negative row counts")
    if cap < P:
        raise ValueError(f"expert parallelism: {cap} rows per round (moe_chunk_tokens x top-k) is less than ep={P}")
    M = max(max(map(sum, rows)), max(map(sum, zip(*rows, strict=True)))) if P else 0
    return -(-M // (cap - P + 1))


def round_bounds(pair: Tensor, rounds: int, r: int) -> tuple[Tensor, Tensor]:
    """Round ``r`` of ``rounds`` carries the rows ``[lo[s, d], hi[s, d])`` of each pair's block.

    Args:
        pair: [P, P] int64 rows per (source, destination).
        rounds: the number of rounds (``n_rounds``), >= 1.
        r: the round, in ``[0, rounds)``.

    Returns:
        (lo, hi), both [P, P] int64: ``floor(r c / R)`` and ``floor((r + 1) c / R)``.
    """
    return r * pair // rounds, (r + 1) * pair // rounds


def round_schedule(pair: Tensor, cap: int) -> Tensor:
    """The whole schedule: [R, P, P] int64, rows source ``s`` sends to destination ``d`` in round ``r``
    (``hi - lo`` of ``round_bounds``); summed over rounds it is ``pair``, and in every round each column (rows a
    rank receives) and each row (rows it sends) sums to at most ``cap``. Deterministic: a function of ``pair`` and
    ``cap`` only. Raises ValueError as ``n_rounds``."""
    R = n_rounds(pair, cap)
    out = []
    for r in range(R):
        lo, hi = round_bounds(pair, R, r)
        out.append(hi - lo)
    return torch.stack(out) if out else pair.new_zeros(0, *pair.shape)


def rows_per_expert(block: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Rows of each (source, local expert) in the slice ``[lo_s, hi_s)`` of each source's expert-sorted block.

    Args:
        block: [P, El] int64, ``counts[s, e]`` of the destination's ``El`` local experts (source ``s``'s block for
            it is expert ``0``'s rows, then expert ``1``'s, ...).
        lo, hi: [P] int64, the round's slice of each source's block (``round_bounds(...)[:, me]``).

    Returns:
        [P, El] int64: ``|[lo_s, hi_s) ∩ [start_e, end_e)|``; its rows sum to ``hi - lo``.
    """
    ends = block.cumsum(1)
    starts = ends - block
    return (torch.minimum(ends, hi[:, None]) - torch.maximum(starts, lo[:, None])).clamp(min=0)


def _exchange(parts: list[Tensor], send: list[int], recv: list[int], group) -> list[Tensor]:
    """All-to-all of rows: ``parts`` are [n_send, w_i] tensors (any dtypes) with the same rows, ``send[d]`` rows
    to rank ``d`` in order; returns [sum(recv), w_i] tensors, ``recv[s]`` rows from rank ``s`` in rank order.
    The parts travel in one ``all_to_all_single`` as bytes (exact for every dtype; gloo and NCCL). With one rank
    (``group`` None) the parts are returned as they are."""
    if group is None:
        return parts
    widths = [p.shape[1] * p.element_size() for p in parts]
    packed = torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)  # [n_send, sum(widths)]
    out = packed.new_empty(sum(recv), sum(widths))
    coll.all_to_all_single(out, packed, output_split_sizes=recv, input_split_sizes=send, group=group)
    res = []
    for p, chunk in zip(parts, out.split(widths, dim=1), strict=True):
        res.append(chunk.contiguous().view(p.dtype))
    return res


@dataclass
class _Plan:
    """Everything both passes need to run the rounds identically (built once per forward by ``_plan``).

    ``counts`` [P, E] int64 (CPU) rows per source and global expert; ``pair`` [P, P] its sums per destination;
    ``order`` [N k] int64 (device) this rank's (token, slot) rows sorted by expert (stable); ``start[d]`` where
    destination ``d``'s block begins in ``order``; ``rounds`` R; ``me`` this rank; ``k`` slots per token;
    ``n_local`` experts per rank; ``limit`` the SwiGLU clamp; ``group`` the EP group (None with one rank)."""

    counts: Tensor
    pair: Tensor
    order: Tensor
    start: list[int]
    rounds: int
    me: int
    k: int
    n_local: int
    limit: float
    group: object

    def round(self, r: int) -> tuple[list[int], list[int], Tensor, Tensor]:
        """Round ``r``: (rows sent to each rank, rows received from each rank, the sent rows' slot ids [n_send]
        int64 in send order (``token = slot // k``), rows received per (source, local expert) [P, El] int64)."""
        lo, hi = round_bounds(self.pair, self.rounds, r)
        me, El = self.me, self.n_local
        send = cpu_values(hi[me] - lo[me])  # the plan is on the host: no device read per round
        pieces = [
            self.order[self.start[d] + a : self.start[d] + b]
            for d, (a, b) in enumerate(zip(cpu_values(lo[me]), cpu_values(hi[me]), strict=True))
        ]
        slots = torch.cat(pieces)
        recv = cpu_values(hi[:, me] - lo[:, me])
        per = rows_per_expert(self.counts[:, me * El : (me + 1) * El], lo[:, me], hi[:, me])
        return send, recv, slots, per


def _group_by_expert(per: Tensor, device) -> tuple[Tensor, list[int]]:
    """Received rows are source-major, expert-sorted inside a source: (the permutation that groups them by local
    expert [n] int64 on ``device``, rows per local expert). ``per`` is on the host: the permutation is made there
    and copied without a sync (``to_device``)."""
    P, El = per.shape
    sizes = cpu_values(per.reshape(-1))
    eid = torch.arange(El).repeat(P).repeat_interleave(per.reshape(-1), output_size=sum(sizes))
    perm = to_device(torch.argsort(eid, stable=True), device)
    return perm, cpu_values(per.sum(0))


def _lora_of(lora: tuple | None, e: int) -> tuple | None:
    """Local expert ``e``'s slices of the stacked adapters ``(A_gu [El, r, D], B_gu [El, 2I, r], A_dn [El, r, I],
    B_dn [El, D, r], scale)`` (a None pair stays None) in ``expert_mlp``'s form; None without adapters."""
    if lora is None:
        return None
    return (*(None if t is None else t[e] for t in lora[:4]), lora[4])


def _run_experts(
    xr: Tensor, per: Tensor, gate_up: Tensor, down: Tensor, limit: float, lora: tuple | None = None
) -> Tensor:
    """Forward of the local experts on received rows xr [n, D] (rows per (source, expert) ``per``) -> [n, D];
    ``lora`` the local experts' stacked adapters (``_lora_of``) or None."""
    perm, sizes = _group_by_expert(per, xr.device)
    xs = xr[perm]
    ys = [
        expert_mlp(xe, gate_up[e], down[e], limit, _lora_of(lora, e))
        for e, xe in enumerate(xs.split(sizes))
        if xe.shape[0]
    ]
    h = torch.empty(xr.shape[0], xr.shape[1], dtype=_out_dtype(xr, gate_up), device=xr.device)
    if ys:
        h[perm] = torch.cat(ys).to(h.dtype)
    return h


def _out_dtype(x: Tensor, gate_up) -> torch.dtype:
    """The dtype an expert returns for x under the current autocast state (the same on every rank)."""
    if isinstance(gate_up, FP8Stack):  # the dtype it dequantizes to, with nothing dequantized
        return torch.nn.functional.linear(x[:0], x.new_empty(0, x.shape[1], dtype=gate_up.dtype)).dtype
    return torch.nn.functional.linear(x[:0], gate_up[0]).dtype


class FP8Stack:
    """The local experts of a weight held in fp8 (``train.frozen_dtype: fp8``; ``genoctx.model.fp8``): ``weight``
    [El, out, in] float8 and ``scale_inv`` [El, ceil(out / b0), ceil(in / b1)] fp32 (the holder's buffers, no copy).
    ``stack[e]`` is expert ``e``'s ``FP8View``, which ``expert_mlp`` dequantizes per use (``fp8_linear``, forward and
    backward): never the local stack at once."""

    def __init__(self, weight: Tensor, scale_inv: Tensor, block: tuple[int, int], dtype: torch.dtype):
        self.weight, self.scale_inv, self.block, self.dtype = weight, scale_inv, block, dtype

    def __getitem__(self, e: int) -> FP8View:
        return FP8View(self.weight[e], self.scale_inv[e], self.block, self.dtype)


def _stacks(ws: list, fp8: tuple | None) -> list:
    """``ws`` (gate_up, down, four adapters, the two scales) with each fp8 base weight as its ``FP8Stack``; the six
    tensors ``expert_mlp`` reads, in ``_EPExperts``' order."""
    ws = list(ws)
    for i in (0, 1):
        if fp8 is not None and fp8[i] is not None:
            ws[i] = FP8Stack(ws[i], ws[6 + i], *fp8[i])
    return ws[:6]


def _backward_experts(
    xr: Tensor, ghr: Tensor, per: Tensor, weights: list, limit: float, scale: float | None, grads: list
) -> tuple[Tensor, Tensor]:
    """Recompute the local experts on received rows xr [n, D] with grad and back-propagate their output gradient
    ghr [n, D].

    ``weights``: the six stacked local tensors ``[gate_up [El, 2I, D], down [El, D, I], A_gu [El, r, D], B_gu [El,
    2I, r], A_dn [El, r, I], B_dn [El, D, r]]`` (an adapter None where there is none); ``scale`` the adapters'
    ``alpha / r`` (None without adapters). ``grads``: one accumulator per entry of ``weights`` (same shape), or None
    where that tensor's gradient is not wanted (a frozen tensor): its gradient is then never computed (autograd
    skips the weight-gradient matmuls of an input that does not require grad). Adds each wanted gradient of expert
    ``e`` into ``grads[i][e]``; returns (dL/dxr [n, D] in xr's dtype, the expert outputs [n, D])."""
    perm, sizes = _group_by_expert(per, xr.device)
    xs, gs = xr[perm], ghr[perm]
    gx = torch.zeros_like(xr)
    h = torch.empty(xr.shape[0], xr.shape[1], dtype=ghr.dtype, device=xr.device)
    off = 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        rows = perm[off : off + n]
        with torch.enable_grad():
            xe = xs[off : off + n].detach().requires_grad_(True)
            ws = [
                None if w is None else w[e] if isinstance(w, FP8Stack) else w[e].detach().requires_grad_(g is not None)
                for w, g in zip(weights, grads, strict=True)
            ]  # (an fp8 expert: its FP8View, dequantized in forward and again for the input gradient, never kept)
            lora = None if scale is None else (*ws[2:], scale)
            he = expert_mlp(xe, ws[0], ws[1], limit, lora)
            wanted = [xe] + [w for w, g in zip(ws, grads, strict=True) if g is not None]
            got = torch.autograd.grad(he, wanted, gs[off : off + n].to(he.dtype))
        dx, rest = got[0], iter(got[1:])
        for g in grads:
            if g is not None:
                g[e] += next(rest)
        gx[rows] = dx
        h[rows] = he.detach().to(h.dtype)
        off += n
    return gx, h


class _EPExperts(torch.autograd.Function):
    """``Σ_slots weight · Expert_e(x_t)`` with the experts spread over the EP ranks (module docstring, 3-4).

    forward(x [N, D], weights [N, k] fp32, plan, combine, scale, fp8, gate_up [El, 2I, D], down [El, D, I], A_gu
    [El, r, D], B_gu [El, 2I, r], A_dn [El, r, I], B_dn [El, D, r], S_gu, S_dn) -> [N, D] in the experts' output
    dtype. ``fp8`` (``train.frozen_dtype: fp8``): None, or per base weight ``(block, dtype)`` where it is held in fp8
    (else None): that weight is then its holder's float8 [El, ...] tensor and ``S_gu`` / ``S_dn`` its ``scale_inv``
    (None otherwise); each local expert is dequantized per use (``FP8Stack``), in forward and in the backward's
    recomputation, as ``Experts.forward`` does in one process; it gets no gradient. The four adapters
    (``genoctx.model.lora``; each None where there is none, ``scale`` None without any) add
    ``scale · (h A_e^T) B_e^T`` to expert ``e``'s projections inside ``expert_mlp``, as ``Experts.forward`` does in
    one process. Backward returns the gradients of x, weights and of each local tensor that requires grad; a frozen
    one (``requires_grad`` False: ``train.trainable`` without ``experts``) gets None and its weight-gradient matmuls
    never run.
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, weights: Tensor, plan: _Plan, combine: str, scale: float | None, fp8: tuple | None, *ws: Tensor
    ) -> Tensor:
        gate_up, down, *adapters = _stacks(ws, fp8)
        lora = None if scale is None else (*adapters, scale)
        N, D = x.shape
        hd = _out_dtype(x, gate_up)
        acc = torch.promote_types(hd, weights.dtype)
        slot_sum = combine == "slot_sum"  # deterministic: each slot's row in its place, summed in slot order at the end
        out = torch.zeros(N * plan.k if slot_sum else N, D, dtype=acc, device=x.device)
        w = weights.reshape(-1)
        for r in range(plan.rounds):
            send, recv, slots, per = plan.round(r)
            tok = slots // plan.k
            (xr,) = _exchange([x[tok]], send, recv, plan.group)
            h = _run_experts(xr, per, gate_up, down, plan.limit, lora)
            (hb,) = _exchange([h], recv, send, plan.group)
            if slot_sum:
                out.index_copy_(0, slots, hb * w[slots].unsqueeze(-1))
            else:
                out.index_add_(0, tok, hb * w[slots].unsqueeze(-1))
            del xr, h, hb  # this round's rows and activations go before the next round
        if slot_sum:
            out = out.view(N, plan.k, D).sum(1)
        present = [t is not None for t in ws]
        ctx.save_for_backward(x, weights, *(t for t in ws if t is not None))
        ctx.present, ctx.scale, ctx.fp8 = present, scale, fp8
        ctx.plan, ctx.hd, ctx.combine = plan, hd, combine
        dev = x.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return out.to(hd)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weights, *saved = ctx.saved_tensors
        it = iter(saved)
        ws = [next(it) if p else None for p in ctx.present]
        stacks = _stacks(ws, ctx.fp8)
        plan, hd = ctx.plan, ctx.hd
        dev, enabled, dtype = ctx.autocast
        acc = torch.promote_types(hd, weights.dtype)
        g = grad.to(acc)  # gradient of the [N, D] accumulator (out = acc.to(hd))
        w = weights.reshape(-1)
        slot_sum = ctx.combine == "slot_sum"
        gx = x.new_zeros(x.shape[0] * plan.k, x.shape[1], dtype=acc) if slot_sum else torch.zeros_like(x)
        gw = torch.zeros_like(w)
        need_w = ctx.needs_input_grad[6:]
        # accumulators only for what trains: a frozen expert weight gets no buffer and no weight-gradient matmul
        grads = [torch.zeros_like(t) if t is not None and need else None for t, need in zip(ws, need_w, strict=True)]
        with torch.autocast(dev, dtype=dtype, enabled=enabled):
            for r in range(plan.rounds):
                send, recv, slots, per = plan.round(r)
                tok = slots // plan.k
                gwt = g[tok]  # gradient of weight · output, [n_send, D] in acc
                gh = (gwt * w[slots].unsqueeze(-1)).to(hd)
                xr, ghr = _exchange([x[tok], gh], send, recv, plan.group)
                gxr, hr = _backward_experts(xr, ghr, per, stacks, plan.limit, ctx.scale, grads[:6])
                gxs, hs = _exchange([gxr, hr], recv, send, plan.group)
                if slot_sum:
                    gx.index_copy_(0, slots, gxs.to(acc))
                else:
                    gx.index_add_(0, tok, gxs)
                gw[slots] = (gwt * hs).sum(-1).to(gw.dtype)
                del xr, ghr, gxr, hr, gxs, hs
        if slot_sum:
            gx = gx.view(x.shape[0], plan.k, x.shape[1]).sum(1).to(x.dtype)
        need = ctx.needs_input_grad
        return (gx if need[0] else None, gw.view_as(weights) if need[1] else None, None, None, None, None, *grads)


def _plan(experts: torch.Tensor, ex: Experts, cap: int) -> _Plan:
    """Exchange the counts (one all-gather of [E] int64 over the EP group) and build this forward's ``_Plan``."""
    E, P, me, El = ex.n_experts, ex.ep_size, ex.ep_rank, ex.n_local_experts
    flat = experts.reshape(-1)
    mine = flat.new_zeros(E).index_add_(0, flat, torch.ones_like(flat))  # not bincount: on CUDA it reads the max
    if ex.ep_group is None:
        gathered = mine[None]
    else:
        parts = [torch.empty_like(mine) for _ in range(P)]
        coll.all_gather(parts, mine, group=ex.ep_group)
        gathered = torch.stack(parts)
    # the one host read of this MoE forward (every round's split sizes follow from it; module docstring)
    counts = torch.tensor(read(gathered, label="ep.counts"), dtype=torch.long)  # [P, E] on the host
    pair = counts.view(P, P, El).sum(-1)
    start = [0, *cpu_values(pair[me].cumsum(0))[:-1]]
    return _Plan(
        counts=counts,
        pair=pair,
        order=torch.argsort(flat, stable=True),
        start=start,
        rounds=n_rounds(pair, cap),
        me=me,
        k=experts.shape[1],
        n_local=El,
        limit=ex.swiglu_limit,
        group=ex.ep_group,
    )


def _ep_experts_forward(ex: Experts, x: Tensor, experts: Tensor, weights: Tensor, cap: int) -> Tensor:
    """EP forward of an ``Experts`` module: x [N, D], global expert ids [N, k] int64, weights [N, k] fp32 ->
    [N, D] (``Experts.forward``'s result, the experts spread over the EP group). A collective: every EP rank
    must call it. Sets ``ex.ep_stats`` (``ep_received_rows``, ``ep_max_round_rows``, ``ep_rounds``)."""
    plan = _plan(experts, ex, cap)
    ex.combine = combine_path()  # as Experts.forward: index_add, or slot_sum under train.deterministic
    adapters = [getattr(ex, f"{n}_lora_{ab}", None) for n in ("gate_up_proj", "down_proj") for ab in "AB"]
    hs = [held(ex, n) for n in ("gate_up_proj", "down_proj")]  # fp8 holders (train.frozen_dtype: fp8) or None
    base = [getattr(ex, n) if h is None else h.weight for n, h in zip(("gate_up_proj", "down_proj"), hs, strict=True)]
    scales = [None if h is None else h.scale_inv for h in hs]
    fp8 = None if hs == [None, None] else tuple(None if h is None else (h.block, h.dtype) for h in hs)
    y = _EPExperts.apply(x, weights, plan, ex.combine, ex.lora_scale, fp8, *base, *adapters, *scales)
    lo_hi = [round_bounds(plan.pair, plan.rounds, r) for r in range(plan.rounds)]
    rows = [cpu_values((hi[:, plan.me] - lo[:, plan.me]).sum()) for lo, hi in lo_hi]  # host plan: no device read
    ex.ep_stats = {"ep_received_rows": sum(rows), "ep_max_round_rows": max(rows, default=0), "ep_rounds": len(rows)}
    return y


def _ep_moe_forward(moe: MoE, x: Tensor) -> Tensor:
    """EP forward of a ``MoE``: x [B, T, D] -> [B, T, D] (module docstring). Router and shared expert run locally
    in chunks of ``moe_chunk_tokens`` (checkpointed as ``MoE.forward`` does); the routed experts through
    ``moe.experts`` (the EP exchange, in rounds of at most ``moe_chunk_tokens * top_k`` received rows). Sets
    ``stats`` (``MoE``'s keys plus ``ep_received_rows``, ``ep_max_round_rows``, ``ep_rounds``) and ``aux_loss``."""
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    seq = torch.arange(B, device=x.device).repeat_interleave(T)
    use_ckpt = moe.recompute and torch.is_grad_enabled()
    routes, weights, shared, sels, psums = [], [], [], [], []
    tokens_per_expert = torch.zeros(moe.n_experts, dtype=torch.long, device=x.device)
    for start in range(0, B * T, moe.chunk_tokens):
        xc, sc = flat[start : start + moe.chunk_tokens], seq[start : start + moe.chunk_tokens]
        out = checkpoint(moe._local, xc, sc, B, use_reentrant=False) if use_ckpt else moe._local(xc, sc, B)
        routes.append(out[0])
        weights.append(out[1])
        shared.append(out[2])
        tokens_per_expert += out[3]
        sels.append(out[4])
        psums.append(out[5])
    if routes:
        experts, w = torch.cat(routes), torch.cat(weights)
    else:  # no tokens here; the exchange still runs (the other ranks may send to this one)
        experts = torch.zeros(0, moe.top_k, dtype=torch.long, device=x.device)
        w = flat.new_zeros(0, moe.top_k, dtype=torch.promote_types(flat.dtype, torch.float32))
    y = moe.experts(flat, experts, w)
    if moe.shared_experts is not None and shared:
        y = y + torch.cat(shared).to(y.dtype)
    moe._record(tokens_per_expert, [s for s in sels if s is not None], [p for p in psums if p is not None], T)
    moe.stats.update(moe.experts.ep_stats)
    return y.view(B, T, D)


class _EPOverride:
    """Handle of one ``apply_ep`` override: ``remove()`` deletes the instance ``forward`` of the MoE and of its
    ``Experts`` (the class forwards return). The parameters stay this rank's block of experts: the class forward
    is then only right with ``ep_size == 1`` or after full expert weights are loaded back, and ``apply_ep`` refuses
    the model again (its experts are already split)."""

    def __init__(self, moe: MoE):
        self.modules = (moe, moe.experts)

    def remove(self) -> None:
        for m in self.modules:
            if "forward" in vars(m):
                del m.forward


# an Experts module's tensors split on dim 0 (experts): the base weights, then LoRA's expert-first adapters
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_lora_A", "gate_up_proj_lora_B", "down_proj_lora_A",
                  "down_proj_lora_B")  # fmt: skip


def apply_ep(model: nn.Module, ep_group, ep_size: int, ep_rank: int) -> list[_EPOverride]:
    """Spread the routed experts of every ``MoE`` in ``model`` over the EP group (module docstring).

    For each MoE: ``experts.gate_up_proj`` [E, 2I, D] and ``experts.down_proj`` [E, D, I] (and their LoRA adapters,
    ``genoctx.model.lora``, stored expert-first: ``*_lora_A`` [E, r, in], ``*_lora_B`` [E, out, r]; ``EXPERT_TENSORS``)
    are replaced by new ``nn.Parameter``s (same ``requires_grad``) holding clones of rows ``[ep_rank E / ep_size,
    (ep_rank + 1) E / ep_size)`` (so call this before building the optimizer), each marked ``_genoctx_expert =
    True``; the ``Experts`` module records ``ep_size``, ``ep_rank``, ``expert_offset`` (its first global expert),
    ``n_local_experts`` and ``ep_group`` (``n_experts`` stays E, the router's count); ``forward`` is overridden on the
    MoE and Experts instances.

    Args:
        model: any module containing ``genoctx.model.moe.MoE`` layers (a ``HybridLM``, or a ``MoE`` itself).
        ep_group: the EP process group (gloo or NCCL); None only with ``ep_size == 1`` (no communication: the
            rounds run locally, useful to test the path in one process).
        ep_size: ranks in ``ep_group``.
        ep_rank: this rank's index in ``ep_group``.

    Returns:
        One handle per MoE; ``h.remove()`` restores the class forwards but not the full expert parameters.

    Raises:
        ValueError: ``n_routed_experts`` not divisible by ``ep``, ``moe_chunk_tokens * num_experts_per_tok < ep``,
            ``ep_rank`` outside ``[0, ep_size)``, a group whose size or rank disagree, no group with
            ``ep_size > 1``, or a model with EP already applied.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert parallelism: ep_rank {ep_rank} is not in [0, ep={ep_size})")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:  # check everything before changing anything
        E = moe.experts.n_experts
        if E % ep_size:
            raise ValueError(f"expert parallelism: n_routed_experts={E} is not divisible by ep={ep_size}")
        if moe.chunk_tokens * moe.top_k < ep_size:
            raise ValueError(
                f"expert parallelism: moe_chunk_tokens x num_experts_per_tok = {moe.chunk_tokens * moe.top_k} rows "
                f"per round is less than ep={ep_size}"
            )
        if "forward" in vars(moe) or hasattr(moe.experts, "ep_size"):
            raise ValueError("apply_ep: the model already has expert parallelism applied")
    if ep_group is None and ep_size > 1:
        raise ValueError(f"expert parallelism: ep={ep_size} needs a process group")
    if ep_group is not None and (dist.get_world_size(ep_group), dist.get_rank(ep_group)) != (ep_size, ep_rank):
        raise ValueError(
            f"expert parallelism: the group has {dist.get_world_size(ep_group)} ranks and this is rank "
            f"{dist.get_rank(ep_group)}, but ep={ep_size} and ep_rank={ep_rank} were given"
        )
    handles = []
    for moe in moes:
        ex = moe.experts
        El = ex.n_experts // ep_size
        off = ep_rank * El
        for name in EXPERT_TENSORS:  # the base weights and their expert-first adapters [E, ...], when present
            h = held(ex, name)
            if h is not None:  # held in fp8 (train.frozen_dtype): its fp8 rows and scale blocks, sliced alike
                ex._modules[name + SUFFIX] = h.experts(off, El)
                continue
            old = getattr(ex, name, None)
            if old is None:
                continue
            p = nn.Parameter(old.detach()[off : off + El].clone(), requires_grad=old.requires_grad)
            p._genoctx_expert = True
            setattr(ex, name, p)
        ex.ep_size, ex.ep_rank, ex.expert_offset, ex.n_local_experts = ep_size, ep_rank, off, El
        ex.ep_group = ep_group
        ex.ep_stats = {}

        def experts_forward(self, x, experts, weights, _moe=moe):
            return _ep_experts_forward(self, x, experts, weights, _moe.chunk_tokens * _moe.top_k)

        ex.forward = types.MethodType(experts_forward, ex)
        moe.forward = types.MethodType(_ep_moe_forward, moe)
        handles.append(_EPOverride(moe))
    return handles


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert parameters ``apply_ep`` made (marked ``_genoctx_expert``), in ``model.parameters()``
    order: their gradients are reduced over the ranks holding the same experts, not over the EP group."""
    return [p for p in model.parameters() if getattr(p, "_genoctx_expert", False)]
