"""Context parallelism (CP) and data parallelism (DP) applied from outside the model (torchtitan style).

Layouts. One window of ``L`` tokens is cut into equal pieces of ``c`` tokens and every rank of the CP group
(size ``P``) holds some of them, concatenated in the order listed (``cp_pieces``, ``shard_sequence``):

- ``contiguous`` (default): ``P`` pieces, rank ``r`` holds piece ``r``.
- ``zigzag`` (the load-balanced ring-attention layout of Megatron CP): ``2P`` pieces, rank ``r`` holds pieces
  ``r`` and ``2P - 1 - r`` (rank 0 of CP=2 holds pieces 0 and 3, rank 1 pieces 1 and 2). Turned on by
  ``train.cp_layout: zigzag`` in a recipe or ``--set train.cp_layout=zigzag`` on the command line.

Rank ``r`` runs the unchanged ``HybridLM`` on its pieces. Every position-wise part (embedding, MoE, MLP,
hyper-connections, norms, the loss) needs nothing; ``apply_cp(model, group, layout)`` overrides ``forward`` on
each mixing layer's instance so that it splits its local input into its pieces and gives each piece the
cache that the pieces before it in natural order leave (DESIGN.md, the chunk contract):

- KDA (Kimi Linear; fla ``fla/ops/cp``): the state is linear in the initial state,
  ``S_end = M_p S_init + L_p`` per head and piece (``M_p`` [K, K], ``L_p`` [K, V], fp32). Every rank runs
  ``chunk_kda`` once over its pieces (batched along the batch dim) with values ``[v | 0]`` (width V + K)
  and initial state ``[0 | I]``: the final state is ``[L_p | M_p]``. The short-convolution input of a
  piece is the tail (the last ``conv_size - 1`` pre-convolution q|k|v inputs) of its natural-order
  predecessor, all-gathered first. The ``[L | M]`` of all pieces are all-gathered (autograd-aware, so
  gradients reach the ranks that own them), put in natural order and folded, ``S_0 = 0``,
  ``S_{p+1} = M_p S_p + L_p``; the layer then runs on its pieces with ``KDACache(S_p, tail_{p-1})``.
- DSA (DeepSeek-V3.2 / GLM-5.3-Flash; Megatron's CP for DSA is all-gather only): every rank all-gathers,
  per piece, the MLA latents (``kv_lora_rank`` per token) and, on a "full" layer, the indexer's token keys and
  compress-gate logits, and puts them in natural order; local piece ``p`` runs with
  ``layer.cache_of(...)`` of positions ``[0, p c)``: those latents, the pooled keys of the complete pools and
  the raw keys/gates of the incomplete last pool, so a pool that straddles two pieces is pooled exactly as in
  one pass. A full layer returns the selections of its local pieces concatenated along T (``DSASelection``
  carries absolute query positions); a "shared" layer splits the selection it receives per local piece
  (``selection.rows``). Each rank scores only its own queries, recorded per rank in
  ``layer.self_attn.stats["keys_scored"]`` ((query, pool) pairs, summed over its pieces; ``aux_loss`` is the
  mean of the pieces' losses).
- MoE / MLP: nothing (position-wise).

Streaming (forward-only evaluation, ``apply_cp(..., chunk_tokens=N)``): a mixing layer runs each local piece as
consecutive chunks of ``N`` tokens, each after the cache the previous chunk left (the chunk contract), starting from
the piece's cache above; the KDA ``[L | M]`` pass streams the same way (``chunk_kda`` carries the extended state).
The layer's working set is then that of one chunk; what grows with the piece is only its residual streams and the
DSA caches (the gathered window). Equal to one call per piece to fp32 rounding.

Carried caches (chunked training, ``genoctx.train.chunked``: each rank chunks its piece). A mixer's ``cache``
argument is then the cache of the positions before the pieces it runs (a previous round of ``cp`` chunks; the same
on every rank): the KDA fold starts from its state and piece 0's convolution input is its tail; each DSA piece's
cache is its latents and pools extended by the gathered ones before the piece (``join_latents``,
``Indexer.extend``). Inside ``carrying_cache()`` the mixers return the cache after their last piece (the KDA fold run
one step further with the last piece's tail; the DSA latents and pools of every position), the same on every rank;
outside it they return None.

Balance. Causal attention makes later positions cost more: the query at position ``t`` scores the
``(t + 1) // kpool`` complete pools it sees (``kpool = index_kpool``), so piece ``p`` scores about
``(c^2 p + c (c + 1) / 2) / kpool`` pools. Contiguous, the last rank scores the most (busiest / mean 1.5 at
CP=2). Zigzag pairs piece ``r`` with piece ``2P - 1 - r``, so every rank scores about
``(c^2 (2P - 1) + c (c + 1)) / kpool`` pools: equal on all ranks up to the rounding down of ``(t + 1) / kpool``
(less than one pool per query), and exactly ``c (2 P c + 2 - kpool) / kpool`` on every rank when ``kpool``
divides ``c`` (``rank_imbalance.dsa_keys_scored_max_over_mean`` = 1.0 in the Ray run summary). Its cost is
small: the KDA fold runs over ``2P`` pieces instead of ``P`` (``2P - 1`` products of [K, K] by [K, V] per head:
negligible) and each rank runs its two pieces' DSA calls one after the other. The window must split into ``2P``
pieces of at least ``linear_conv_kernel_dim - 1`` tokens (``genoctx train`` checks this before starting); pieces
need not be multiples of ``index_kpool`` or ``kda_chunk_size``.

Every rank runs the same collectives in the same order, forward and backward: each gathered tensor is
stacked, reordered and also tied into the layer output with weight 0, so every rank's backward runs each
gather's reduce-scatter even where its own pieces use nothing of it (rank 0, contiguous). Cost: the KDA
core runs twice per layer (once for ``[L | M]``, once in the layer), the DSA latent and indexer-key projections
run twice, and every rank pools the indexer keys of the positions before each of its pieces.

Loss and gradients (DESIGN.md): each rank back-propagates ``local loss sum / global scored count``
(the count all-reduced over CP x DP first, clamped at 1), plus its auxiliary losses weighted by its share of
the global queries; gradients are then summed over CP x DP. The sum of the ranks' objectives is exactly the
one-process objective over the whole batch, so CP=2 equals CP=1 (either layout) and DP=2 equals one
process with both windows batched, to fp32 rounding. A rank whose pieces are all N adds 0 to the sum and
the count: no NaN. (The optional MoE sequence-wise balance loss, ``moe_aux_loss_coef > 0``, is a product of
per-sequence means and is only approximated under CP.)

Process groups come from the one device mesh of ``genoctx.parallel.mesh`` (``init_parallel``), on gloo (CPU) or
NCCL (CUDA); ``ParallelDims`` answers which dims are on and which layout CP uses.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..model.config import DSA
from ..model.dsa import SENTINEL, DSACache, DSASelection, join_latents
from ..model.kda import KDACache, chunk_kda
from ..model.moe import MoE
from . import collectives as coll
from .layout import cp_pieces


def shard_sequence(x: Tensor, cp: int, cp_rank: int, layout: str = "contiguous") -> Tensor:
    """Rank ``cp_rank``'s pieces of ``x`` ``[B, L, ...]`` along dim 1, concatenated in local order.

    Contiguous: ``[B, L / cp, ...]``, slice ``cp_rank``. Zigzag: ``[B, L / cp, ...]`` made of pieces
    ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``L / (2 cp)`` tokens. Same dtype and device as ``x``.

    Raises:
        ValueError: ``L`` is not a multiple of the number of pieces (``cp``, or ``2 cp`` for zigzag), a bad
            ``cp_rank``, or an unknown layout.
    """
    pieces = cp_pieces(cp, layout)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context parallelism: cp_rank {cp_rank} is not in [0, {cp})")
    n = sum(len(p) for p in pieces)
    L = x.shape[1]
    if L % n:
        raise ValueError(
            f"context parallelism: sequence length {L} is not a multiple of {n} pieces (cp={cp}, {layout} layout)"
        )
    c = L // n
    parts = [x[:, p * c : (p + 1) * c] for p in pieces[cp_rank]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 whose backward sends each rank the sum of every rank's gradient for its part.

    Forward: ``x`` [n, ...] on each of the P ranks -> [P n, ...] (rank-major). Backward: ``all_to_all_single`` of
    the [P n, ...] gradient (part q goes to rank q), then the P received parts are summed: a reduce-scatter built
    from the one collective gloo and NCCL both have for subgroups (torch.distributed.nn.functional.all_gather's
    backward calls ``scatter`` with group ranks as global ranks and fails on a subgroup such as a CP group of a
    larger mesh).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        P = dist.get_world_size(group)
        out = x.new_empty((P * x.shape[0], *x.shape[1:]))
        coll.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        P = dist.get_world_size(ctx.group)
        recv = torch.empty_like(grad)
        coll.all_to_all_single(recv, grad.contiguous(), group=ctx.group)
        return recv.view(P, grad.shape[0] // P, *grad.shape[1:]).sum(0), None


def _all_gather(x: Tensor, group) -> list[Tensor]:
    """Autograd-aware all-gather: ``x`` [n, ...] -> the P ranks' tensors (a list, rank order); backward sums each
    rank's gradient contributions back to its owner (``_AllGather``)."""
    return list(_AllGather.apply(x, group).chunk(dist.get_world_size(group), dim=0))


class CPLayout:
    """This rank's view of a CP layout (built by ``apply_cp``): its pieces (``mine``, natural indices in local
    order), the permutation from gathered (rank-major) to natural piece order and how a piece is streamed.

    Args:
        group: the CP process group (this rank's rank and the group size come from it).
        layout: ``"contiguous"`` or ``"zigzag"`` (``cp_pieces``).
        chunk_tokens: stream each local piece through a mixing layer in chunks of at most this many tokens with the
            carried cache (the chunk contract), so that a layer's working set is bounded by the chunk, not the piece
            (forward-only evaluation, ``genoctx eval --cp C --chunk-tokens N``); None = the whole piece in one call
            (training).

    Raises:
        ValueError: an unknown layout, or ``chunk_tokens < 1``.
    """

    def __init__(self, group, layout: str, chunk_tokens: int | None = None):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"context parallelism: chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.group = group
        self.rank = dist.get_rank(group)
        pieces = cp_pieces(dist.get_world_size(group), layout)
        self.mine = pieces[self.rank]  # natural indices of the local pieces, in local order
        self.n_local = len(self.mine)
        self.n_pieces = sum(len(p) for p in pieces)
        flat = {p: r * self.n_local + j for r, ps in enumerate(pieces) for j, p in enumerate(ps)}
        self._perm = [flat[p] for p in range(self.n_pieces)]
        self._index_on: dict = {}

    def _index(self, name: str, device: torch.device) -> Tensor:
        """``self.<name>`` (a host list of piece indices) as an int64 tensor on ``device``, made once per device: a
        host -> device copy per call would be a host sync per layer and round (``genoctx.model.host``)."""
        t = self._index_on.get((name, device))
        if t is None:
            t = self._index_on[(name, device)] = torch.as_tensor(getattr(self, name)).to(device)
        return t

    def gather_natural(self, x: Tensor) -> Tensor:
        """``x`` ``[n_local, ...]`` (this rank's pieces) -> ``[n_pieces, ...]`` of all ranks, natural order.
        Differentiable: backward returns each rank its pieces' gradient (the gather's reduce-scatter)."""
        stacked = torch.cat(_all_gather(x, self.group), dim=0)  # rank-major, local order inside a rank
        return stacked.index_select(0, self._index("_perm", x.device))

    def local(self, x: Tensor) -> Tensor:
        """Rows ``self.mine`` of ``x`` ``[n_pieces, ...]`` -> ``[n_local, ...]``."""
        return x.index_select(0, self._index("mine", x.device))

    def split(self, x: Tensor) -> tuple[int, int]:
        """``(B, c)`` for a local input ``x`` ``[B, n_local c, ...]``; ValueError when it does not split."""
        B, T = x.shape[:2]
        if T % self.n_local:
            raise ValueError(f"context parallelism: {T} local tokens do not split into {self.n_local} pieces")
        return B, T // self.n_local

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """The ``[s, e)`` token spans in which ``[start, end)`` of a piece is streamed: ``chunk_tokens`` each (the
        last one shorter), or the whole range when ``chunk_tokens`` is None."""
        step = self.chunk_tokens or max(1, end - start)
        return [(s, min(s + step, end)) for s in range(start, end, step)]


def _to_batch(x: Tensor, n: int) -> Tensor:
    """``[B, n c, ...]`` -> ``[n B, c, ...]`` (piece-major: rows ``j B .. (j + 1) B`` are local piece ``j``)."""
    B, T = x.shape[:2]
    return x.reshape(B, n, T // n, *x.shape[2:]).transpose(0, 1).reshape(n * B, T // n, *x.shape[2:])


def _from_batch(y: Tensor, n: int) -> Tensor:
    """Inverse of ``_to_batch``: ``[n B, c, ...]`` -> ``[B, n c, ...]``."""
    nB, c = y.shape[:2]
    B = nB // n
    return y.reshape(n, B, c, *y.shape[2:]).transpose(0, 1).reshape(B, n * c, *y.shape[2:])


def _state_pass(mixer, x: Tensor, conv_state: Tensor, LM: Tensor) -> tuple[Tensor, Tensor]:
    """One span of the ``[L | M]`` pass of ``kda_cp_cache``: the layer's projections of x ``[rows, t, D]`` after the
    pre-convolution tail ``conv_state``, then ``chunk_kda`` with values ``[v | 0]`` from the state ``LM`` ``[rows, H,
    K, V + K]``. Returns the state after the span and the new conv tail."""
    q, k, v, g, beta, cs = mixer.project(x, conv_state)
    rows, t, H, K = k.shape
    v_ext = torch.cat([v, v.new_zeros(rows, t, H, K)], dim=-1)  # [v | 0]
    _, LM = chunk_kda(
        q, k, v_ext, g, beta, initial_state=LM, chunk_size=mixer.chunk_size,
        block_tokens=mixer.block_tokens, recompute=mixer.recompute,
    )  # fmt: skip
    return LM, cs


def kda_cp_cache(
    mixer, x: Tensor, layout: CPLayout, prior: KDACache | None = None
) -> tuple[KDACache, Tensor, KDACache]:
    """The ``KDACache`` each local piece needs: what the natural-order pieces before it leave.

    Args:
        mixer: a ``KimiDeltaAttention`` layer.
        x: ``[B, n_local c, hidden_size]`` this rank's layer input, its pieces concatenated (``c`` equal on all
            ranks, ``c >= conv_size - 1``).
        layout: this rank's ``CPLayout``.
        prior: the cache of the positions before the pieces (the same on every rank: the previous round of the
            chunked backward, ``genoctx.train.chunked``; ``state [B, H, K, V]`` fp32, ``conv_state [B, w, 3 H K]``),
            or None (the pieces start the window).

    Returns:
        ``(KDACache(state [n_local B, H, K, V] fp32, conv_state [n_local B, conv_size - 1, 3 H K]), zero, out)``:
        the local pieces' caches, batched piece-major (``_to_batch``), differentiable w.r.t. every rank's ``x``,
        ``prior`` and the layer's parameters (through the autograd-aware all-gathers); ``zero`` (a 0-dim tensor
        equal to 0) ties every gathered value into the layer output; ``out`` the cache after the last piece
        (``state [B, H, K, V]``, ``conv_state [B, w, 3 H K]``), the same on every rank.

    Raises:
        ValueError: ``c < conv_size - 1`` or a local length that does not split into the local pieces.
    """
    n = layout.n_local
    B, c = layout.split(x)
    w = mixer.conv_size - 1
    if c < w:
        raise ValueError(f"context parallelism: a piece of {c} tokens is shorter than the KDA conv tail ({w})")
    xb = _to_batch(x, n)  # [n B, c, D]
    xt = xb[:, c - w :]
    tail = torch.cat([mixer.q_proj(xt), mixer.k_proj(xt), mixer.v_proj(xt)], dim=-1)  # [n B, w, 3 H K]
    tails = layout.gather_natural(tail.reshape(n, B, w, -1))  # [N, B, w, 3 H K]
    first = torch.zeros_like(tails[:1]) if prior is None else prior.conv_state.to(tails.dtype)[None]
    prev = torch.cat([first, tails[:-1]])  # prev[p]: tail of piece p - 1 (the prior's, or 0, for p = 0)
    conv_state = layout.local(prev).reshape(n * B, w, -1)
    H, K = mixer.n_heads, mixer.head_dim
    V = K  # the layer's value width (v_proj is H K wide)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=ct, device=x.device).expand(n * B, H, K, K)
    LM = torch.cat([x.new_zeros(n * B, H, K, V, dtype=ct), eye], -1)  # [0 | I]
    ckpt = mixer.recompute and torch.is_grad_enabled()
    cs = conv_state
    for s, e in layout.spans(0, c):  # streamed over the piece's chunks (one call when layout.chunk_tokens is None)
        args = (mixer, xb[:, s:e], cs, LM)
        # with recompute the pass keeps only its input and the states (the core's blocks again inside backward)
        LM, cs = checkpoint(_state_pass, *args, use_reentrant=False) if ckpt else _state_pass(*args)
    LMs = layout.gather_natural(LM.reshape(n, B, H, K, V + K))  # [N, B, H, K, V + K]
    with torch.autocast(device_type=x.device.type, enabled=False):  # the state stays fp32
        S = LMs.new_zeros(B, H, K, V) if prior is None else prior.state.to(LMs.dtype)
        states = [S]
        for p in range(layout.n_pieces):  # the same ops on every rank
            L_p, M_p = LMs[p].split([V, K], dim=-1)
            S = M_p @ S + L_p
            states.append(S)
        state = layout.local(torch.stack(states[:-1])).reshape(n * B, H, K, V)
    zero = (tails.sum() + LMs.sum()) * 0.0
    out = KDACache(state=states[-1], conv_state=tails[-1].clone())  # a copy: a view would keep every piece's tail
    return KDACache(state=state, conv_state=conv_state), zero, out


def dsa_cp_cache(
    layer, x: Tensor, layout: CPLayout, prior: DSACache | None = None, out: bool = False
) -> tuple[list[DSACache | None], Tensor, DSACache | None]:
    """The ``DSACache`` of each local piece: latents (and pooled indexer keys) of the natural positions before it.

    Args:
        layer: a ``DeepSeekSparseAttention`` layer ("full": with an indexer; "shared": ``layer.indexer`` None).
        x: ``[B, n_local c, hidden_size]`` this rank's layer input, its pieces concatenated (``c`` equal on all
            ranks; any ``c >= 1``, a multiple of ``index_kpool`` or not).
        layout: this rank's ``CPLayout``.
        prior: the cache of the ``S0`` positions before the pieces (the same on every rank: the previous round of
            the chunked backward, ``genoctx.train.chunked``), or None (``S0 = 0``: the pieces start the window).
        out: also build the cache after the last piece.

    Returns:
        ``(caches, zero, out_cache)``: for local piece ``j`` (natural index ``p``) the ``prior`` when ``p == 0``,
        else ``layer.cache_of``-style ``DSACache(latent [B, S0 + p c, kv_lora_rank], pool_k [B, (S0 + p c) // kpool,
        d_I], tail_k, tail_gate [B, (S0 + p c) % kpool, d_I])`` (latents only on a shared layer), each tensor in
        the dtype the layer computes it in; differentiable, through the autograd-aware all-gather, w.r.t. every
        rank's ``x`` (latents), ``prior`` and indexer parameters (the indexer keys are computed from
        ``x.detach()``, as in the layer's forward). ``zero`` (a 0-dim tensor equal to 0) must be added to the
        layer output so that every rank's backward runs the gather's collective. ``out_cache``: the positions
        ``[0, S0 + N c)`` (every piece; the same on every rank) when ``out``, else None.

    Raises:
        ValueError: a local length that does not split into the local pieces.
    """
    n = layout.n_local
    B, c = layout.split(x)
    parts = [layer.latent(x)]  # [B, T, R]
    if layer.indexer is not None:  # the indexer learns only from its KL: detached input, as in the forward
        parts += list(layer.indexer.keys(x.detach()))  # k_tok, gate_tok [B, T, d_I]
    dtypes = [t.dtype for t in parts]
    widths = [t.shape[-1] for t in parts]
    wide = dtypes[0]
    for dt in dtypes[1:]:
        wide = torch.promote_types(wide, dt)  # one gather in the widest dtype: the casts back are exact
    packed = torch.cat([t.to(wide) for t in parts], dim=-1)  # [B, T, W]
    nat = layout.gather_natural(packed.reshape(B, n, c, -1).transpose(0, 1))  # [N, B, c, W]
    seq = nat.transpose(0, 1).reshape(B, layout.n_pieces * c, -1)  # the whole window in natural order
    full = [t.to(dt) for t, dt in zip(seq.split(widths, dim=-1), dtypes, strict=True)]
    latent, index_k, index_gate = (full + [None, None])[:3]

    def before(S: int) -> DSACache | None:  # the cache of positions [0, S0 + S)
        if S == 0:
            return prior
        if prior is None:
            return layer.cache_of(latent[:, :S], *(None if t is None else t[:, :S] for t in (index_k, index_gate)))
        # in the chunked backward's reverse sweep a view of the forward sweep's latents (DSACache.window), not a copy
        joined = join_latents(prior.latent, latent[:, :S].to(prior.latent.dtype), prior.window)
        if index_k is None:
            return DSACache(joined, window=prior.window)
        return DSACache(joined, *layer.indexer.extend(prior, index_k[:, :S], index_gate[:, :S]), window=prior.window)

    caches = [before(p * c) for p in layout.mine]
    return caches, nat.sum() * 0.0, before(layout.n_pieces * c) if out else None


def cat_selections(sels: list[DSASelection]) -> DSASelection:
    """Selections of consecutive query blocks (same ``kpool``/``tail``) -> one, rows concatenated along T.

    ``pools`` ``[B, T_j, K_j]`` int32 are padded with ``-1`` (empty slots) to the largest ``K_j`` (an early
    piece may see fewer pools than ``index_topk / index_kpool``); ``pos`` ``[T_j]`` int64 are concatenated.
    Returns a ``DSASelection`` with ``pools [B, sum T_j, max K_j]`` and ``pos [sum T_j]``.

    Raises:
        ValueError: no selection, or selections with different ``kpool``/``tail``.
    """
    if not sels:
        raise ValueError("cat_selections: no selection")
    kp, tail = sels[0].kpool, sels[0].tail
    if any((s.kpool, s.tail) != (kp, tail) for s in sels):
        raise ValueError("cat_selections: selections with different kpool or tail")
    if len(sels) == 1:
        return sels[0]
    K = max(s.pools.shape[-1] for s in sels)
    pools = [F.pad(s.pools, (0, K - s.pools.shape[-1]), value=SENTINEL) for s in sels]
    return DSASelection(torch.cat(pools, dim=1), torch.cat([s.pos for s in sels]), kp, tail)


_CARRY = [False]


@contextlib.contextmanager
def carrying_cache():
    """Inside this context the CP mixers return the cache after the last piece of the window part they ran (the same
    on every rank), for the next part's call (``genoctx.train.chunked``: each CP rank chunks its piece). Outside it
    they return None: the pieces' caches are not needed, and returning none frees them before the next layer."""
    old, _CARRY[0] = _CARRY[0], True
    try:
        yield
    finally:
        _CARRY[0] = old


def _kda_forward(module, x: Tensor, cache, layout: CPLayout):
    """CP forward of a KDA layer: every local piece at once (batched), each from its predecessors' cache (streamed in
    chunks of ``layout.chunk_tokens`` with the carried cache when set), the first after ``cache`` (the positions
    before these pieces, the same on every rank; or None). Returns ``(y [B, T, D], the cache after the last piece
    inside ``carrying_cache()``, else None)``."""
    n = layout.n_local
    _, c = layout.split(x)
    new, zero, out = kda_cp_cache(module, x, layout, cache)
    xb = _to_batch(x, n)
    ys = []
    for s, e in layout.spans(0, c):  # the chunk contract: each chunk after the cache the previous one left
        y, new = type(module).forward(module, xb[:, s:e], new)
        ys.append(y)
    y = _from_batch(ys[0] if len(ys) == 1 else torch.cat(ys, dim=1), n)
    return _tie(y, zero), (out if _CARRY[0] else None)


def _dsa_forward(module, x: Tensor, cache, selection: DSASelection | None, layout: CPLayout):
    """CP forward of a DSA layer: one call per local piece with the cache of the positions before it.

    ``selection`` (the previous full layer's, rows in local order; used by a shared layer) is split per local
    piece; with ``layout.chunk_tokens`` each piece is streamed in chunks of that many tokens (the chunk contract).
    ``stats`` keys_scored/keys_attended are summed over the calls, ``indexer_loss`` and ``aux_loss`` averaged (equal
    pieces; chunks of one length). ``cache``: the positions before these pieces (the same on every rank), or None.
    Returns ``(y [B, T, D], the cache after the last piece inside ``carrying_cache()`` else None (see
    ``_kda_forward``), the pieces' selections concatenated along T (``cat_selections``; None in dense mode))``."""
    _, c = layout.split(x)
    caches, zero, out = dsa_cp_cache(module, x, layout, cache, out=_CARRY[0])
    ys, stats, auxes, sels = [], [], [], []
    for j, new in enumerate(caches):
        for r0, r1 in layout.spans(j * c, (j + 1) * c):  # each chunk after the cache the previous one left
            sel_in = None if selection is None else selection.rows(r0, r1)
            y, new, sel = type(module).forward(module, x[:, r0:r1], new, sel_in)
            ys.append(y)
            sels.append(sel)
            stats.append(module.stats)
            auxes.append(module.aux_loss)
    merged = dict(stats[-1])
    for key in ("keys_scored", "keys_attended"):  # ints or device tensors (read after the step: no sync here)
        merged[key] = sum(0 if s.get(key) is None else s[key] for s in stats)  # no truth test of a tensor
    losses = [s.get("indexer_loss") for s in stats]
    merged["indexer_loss"] = None if any(v is None for v in losses) else sum(losses) / len(losses)
    module.stats = merged
    module.aux_loss = None if any(a is None for a in auxes) else torch.stack(auxes).mean()
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
    out_sel = None if any(s is None for s in sels) else cat_selections(sels)
    return _tie(y, zero), out, out_sel


def _tie(y: Tensor, zero: Tensor) -> Tensor:
    """``y + zero`` when gradients are on (every rank's backward then runs the gathers' collectives); ``y`` itself
    under ``torch.no_grad`` (evaluation: no copy of the layer output)."""
    return y + zero.to(y.dtype) if torch.is_grad_enabled() else y


class _ForwardOverride:
    """Handle of one ``apply_cp`` override: ``remove()`` deletes the instance ``forward`` (the class's returns)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        if "forward" in vars(self.module):
            del self.module.forward


def apply_cp(model: nn.Module, cp_group, layout: str = "contiguous", chunk_tokens: int | None = None) -> list:
    """Make ``model`` (a ``HybridLM``) run this rank's pieces of a window (``cp_pieces``) per rank of ``cp_group``.

    Overrides ``forward`` on each layer's mixer instance (``layer.self_attn.forward = <bound wrapper>``): the
    wrapper cuts its input ``[B, n_local c, hidden_size]`` into the local pieces, builds each piece's cache from
    the other ranks (``kda_cp_cache``, ``dsa_cp_cache``) and runs the class ``forward`` on them (a DSA wrapper
    also takes and returns the selection, in local row order). The model's forward is then called on this
    rank's pieces only (``shard_sequence`` with the same layout), with no cache, and the mixers return none (their
    pieces' caches are not those of a whole window); or, in chunked training, with the cache of the window positions
    before the pieces, and inside ``carrying_cache()`` the mixers return the cache after them (module docstring).

    Args:
        model: a ``HybridLM`` (its ``layers``, each with ``layer_type`` and ``self_attn``).
        cp_group: the CP process group (every rank of it must call ``apply_cp`` with the same layout).
        layout: ``"contiguous"`` or ``"zigzag"``.
        chunk_tokens: stream each piece through a mixing layer in chunks of this many tokens (``CPLayout``); None =
            one call per piece.

    Returns:
        The handles (``h.remove()`` on each undoes ``apply_cp``).

    Raises:
        ValueError: an unknown layout, or a mixer that already has a CP override.
    """
    lay = CPLayout(cp_group, layout, chunk_tokens)
    handles = []
    for layer in model.layers:
        mixer = layer.self_attn
        if "forward" in vars(mixer):
            raise ValueError("apply_cp: the model already has a CP forward (remove its handles first)")
        if layer.layer_type == DSA:

            def forward(self, x, cache=None, selection=None):
                return _dsa_forward(self, x, cache, selection, lay)

        else:

            def forward(self, x, cache=None):
                return _kda_forward(self, x, cache, lay)

        mixer.forward = types.MethodType(forward, mixer)
        handles.append(_ForwardOverride(mixer))
    return handles


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """A copy of ``x`` summed over ``group`` (no autograd); ``x`` itself is returned when group is None."""
    if group is None:
        return x
    y = x.detach().clone()
    coll.all_reduce(y, group=group)
    return y


def all_reduce_moe_loads(model: nn.Module, group) -> None:
    """Sum the MoE ``load_counts`` over ``group`` (before ``update_router_biases``), so that every rank moves
    the router biases by the global batch's loads (DeepSeek-V3 aux-loss-free balancing)."""
    for m in model.modules():
        if isinstance(m, MoE):
            coll.all_reduce(m.load_counts, group=group)
