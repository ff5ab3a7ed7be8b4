"""DeepSeek Sparse Attention layer of GLM-5.3-Flash: NoPE MLA over the tokens a KPool lightning indexer selects.

The math is transformers ``glm5_next`` (``Glm5NextTextAttention``, ``Glm5NextTextIndexer``); DeepSeek-V3.2
(arXiv:2512.02556) for the indexer and its training:

- MLA, NoPE (``Glm5NextTextAttention.forward``): ``q = q_b_proj(RMSNorm(q_a_proj x))`` per head
  (``qk_nope_head_dim``); the latent ``c = RMSNorm(kv_a_proj_with_mqa x)`` (``kv_lora_rank``); per head
  ``k = W_UK c``, ``v = W_UV c`` with ``[W_UK; W_UV] = kv_b_proj``; softmax scale ``qk_head_dim^-1/2``;
  ``o_proj``.
- KPool indexer (``Glm5NextTextIndexer.forward``/``get_pooled_states``/``append_visible_tail``): token keys
  ``k_I = LayerNorm(wk x)``; pools of ``index_kpool`` consecutive tokens from position 0 (the first valid
  token: genoctx windows have no padding); pool key ``K_p = sum_i softmax_i(gate_i + ape_i) * k_I,i`` per
  channel, ``gate = index_kpool_compress_gate x``, ``ape = index_kpool_compress_ape``; query ``t`` scores
  every complete pool whose last token it sees: ``I[t, p] = sum_j w[t, j] ReLU(q_I[t, j] . K_p)`` with
  ``q_I = wq_b(RMSNorm(q_a_proj x))`` (the q-LoRA residual), ``w = weights_proj(x) H_I^-1/2 d_I^-1/2``;
  it attends to the tokens of its top ``index_topk / index_kpool`` pools plus, when
  ``index_kpool_always_select_tail``, the visible tokens of its own incomplete pool. A query with nothing
  selected (tail off, fewer than ``index_kpool`` tokens seen) gets a zero output, as the reference's SDPA path.
- ``indexer_types`` "shared": the layer has no indexer and reuses the selection of the full DSA layer right
  before it (``prev_topk_indices``).

Design choices (why this is not the reference's code):

- Absorbed MQA form: queries are mapped into the latent (``q_abs = q W_UK``, ``kv_lora_rank`` wide), every
  head attends to the same gathered latents, and the output latent is mapped out by ``W_UV``. The cache is
  the latent only (``kv_lora_rank`` per token) and one gathered ``[T, K, kv_lora_rank]`` tile serves keys
  and values of all heads. Equal to the reference's expanded form up to rounding.
- Selections are kept as pool indices ``[B, T, topk / kpool]`` (``DSASelection``, int32) and expanded to
  tokens only inside an attention tile: ``index_kpool`` times less memory than token indices.
- The indexer never builds a ``[T, pools]`` score matrix (``indexer_topk``: query tiles under
  ``indexer_tile_tokens``, running top-k with exact threshold pruning, ties toward the most recent pool) and
  attention never builds ``L x L`` (``sparse_mla``: one autograd Function over query tiles that saves only
  q, the latents, the pool indices and the per-row logsumexp, and regathers in backward).
- Sentinel ``-1`` marks empty slots; every consumer masks it (zero weight, no gradient, nothing scattered).
- The indexer learns only from its KL loss (DeepSeek-V3.2): its inputs are detached and top-k is not
  differentiable. Pooled, the KL's target is the main attention's probability mass summed over each pool's
  tokens (heads summed, renormalised over the pools compared; tail tokens are not pools and are left out):
  stage "sparse" over the selected pools, stage "warmup" over every visible complete pool against dense
  attention. ``aux_loss`` holds it times ``indexer_loss_coef``.
- Dense attention runs only when ``dsa_mode == "dense"`` is asked for; the path that ran is in
  ``stats["path"]`` ("sparse" / "dense") with ``stats["indexer"]`` ("full" / "shared").
- On CUDA (fp32/fp16/bf16) the indexer top-k and the sparse attention run the Triton kernels of ``kernels/``
  (``kernels.indexer_topk``, ``kernels.sparse_mla``: same calls as ``indexer_topk`` and ``sparse_mla`` here, tested
  equal to them under the Triton interpreter) unless ``kernels == "torch"``; on CPU this file's PyTorch path runs.
  ``stats["kernel"]`` says which ran ("triton" / "torch"). The kernels are imported only when used, so a CPU
  install without a working Triton imports this module. The indexer KL and dense attention stay PyTorch.
- No host read per layer or chunk (``genoctx.model.host``): the visible pools of each query are computed on the host
  from the positions (``visible_host``), loop bounds from Python ints, and ``stats`` counts and the indexer loss stay
  0-dim device tensors until ``HybridLM.layer_stats`` reads them. The PyTorch top-k's pruning reads thresholds per
  block, so the layer prunes only where host reads are free (a CPU).
- Chunk contract: ``forward(x, cache, selection)`` takes the latents and pooled indexer keys of all earlier
  positions (``DSACache``: latents, complete pools' keys, and the raw keys/gates of the incomplete last pool)
  and returns them extended by this chunk (not detached: gradients reach earlier chunks).
- Selection memo (``selection_memo``, set by ``genoctx.train.chunked`` on full layers for one step): a chunk's top-k
  pools are a deterministic function of its inputs and of the cache before it, so the chunked step's grad pass takes
  the pools its no-grad sweep computed for the same positions ``(S, T)`` instead of scoring again (half the indexer
  top-k FLOPs; bit-identical). It holds ``B T_total K 4`` bytes per full layer (int32 pools of every position).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .host import read, reads_free
from .norms import RMSNorm
from .precision import island
from .stats import host_number

SENTINEL = -1  # index slot with no pool / token
# Indexer scores tie often (ReLU makes many exactly 0). torch.topk breaks ties in an unspecified order, which
# would make the selection depend on how pools are tiled or chunked. Adding pool * TIE_BREAK before the top-k
# makes the selection a fixed function of (query, pool): among equal scores the most recent pools win.
TIE_BREAK = 2.0**-40
ATTN_TILE_TOKENS = 1 << 16  # sparse attention at glm-5.3-flash: query-tile rows x token slots held at once
# sparse attention's tile budget in bytes: ATTN_TILE_TOKENS rows x slots, each a gathered latent and a score per head
# (kv_lora_rank + heads) in fp32, at glm-5.3-flash (512 + 64); narrower models get more rows (attn_tile_tokens)
ATTN_TILE_BYTES = ATTN_TILE_TOKENS * (512 + 64) * 4
# sparse attention: a query tile whose visible keys (cache included) are at most DENSE_RATIO x the selection width
# attends densely to all of them (one matmul, selection as a 0/-inf bias) instead of gathering (``_dense_split``)
DENSE_RATIO = 2.0
INDEX_ROW_TILE = 256  # indexer_topk: query rows per tile (fast path; bounded by indexer_tile_tokens)
INDEX_COL_BLOCK = 4096  # indexer_topk: key columns per block (a multiple of INDEX_GROUP)
INDEX_GROUP = 32  # indexer_topk: key columns per pruning group (block maxima are compared to the threshold)
# indexer_topk on a CPU: a call that scores at least this many visible (query, key) pairs takes its query tiles'
# group maxima from one compiled kernel (``_grouped_topk``); smaller calls stay eager (the compile would cost more)
INDEX_COMPILE_PAIRS = 1 << 32
INDEX_COMPILE_TERMS = 32  # ... for indexers of at most this many index_n_heads x index_head_dim terms (tiny: 2 x 8)
INDEX_GROUPED_BLOCKS = 4  # ... and for query tiles whose every row sees at least this many key blocks (shorter: eager)


def attn_tile_tokens(kv_lora_rank: int, heads: int) -> int:
    """Query rows x token slots of one sparse-attention tile (``_SparseMLA``, ``_IndexerKLSparse``) for a layer of
    ``heads`` MLA heads over ``kv_lora_rank``-wide latents: ``ATTN_TILE_BYTES // ((kv_lora_rank + heads) * 4)``, so
    that a tile's working set (gathered fp32 latents and per-head scores, ``rows x slots x (R + H) x 4`` bytes) is
    what ``ATTN_TILE_TOKENS`` gives at glm-5.3-flash (exactly ``ATTN_TILE_TOKENS`` there; cpu-small 555128, tiny
    2097152)."""
    return max(1, ATTN_TILE_BYTES // ((kv_lora_rank + heads) * 4))


@dataclass
class DSACache:
    """What a DSA layer carries from one chunk to the next: ``S`` earlier positions (``S`` may be 0).

    Attributes:
        latent: ``[B, S, kv_lora_rank]`` normalised MLA latents (keys and values of every head).
        pool_k: ``[B, S // index_kpool, d_I]`` pooled indexer keys of the complete pools (fp32, fp64 for an fp64
            model), or None (shared layer).
        tail_k: ``[B, S % index_kpool, d_I]`` indexer keys of the incomplete last pool's tokens, or None.
        tail_gate: ``[B, S % index_kpool, d_I]`` their compress-gate logits, or None.
        window: ``[B, >= S + T, kv_lora_rank]`` the latents of the whole window, already computed (the chunked
            backward's forward sweep, ``genoctx.train.chunked``), or None. When set, the layer's latents
            ``cat(latent, own)`` are this tensor's first ``S + T`` positions (``_Splice``: no copy), while gradients
            still flow to ``latent`` and to the chunk's own projection as through the concatenation.
    """

    latent: Tensor
    pool_k: Tensor | None = None
    tail_k: Tensor | None = None
    tail_gate: Tensor | None = None
    window: Tensor | None = None
    views: ClassVar[tuple[str, ...]] = ("window",)  # not state: ``ModelCache.map_tensors``/``tensors`` skip it

    @property
    def length(self) -> int:
        """Number of cached positions ``S``."""
        return self.latent.shape[1]


class _Splice(torch.autograd.Function):
    """``cat([past, own], dim=1)`` whose values are already in ``window`` (computed by an earlier forward of the same
    positions): forward returns ``window[:, :S + T]`` (a view, no copy), backward splits the gradient into views for
    ``past`` ``[B, S, R]`` and ``own`` ``[B, T, R]``. Exact when ``window`` holds what ``past`` and ``own`` hold (the
    chunked backward recomputes ``own`` from the same inputs with the same kernels; under CP the window's values of a
    rank's own positions come from the gather of the whole piece's projection, equal up to the rounding of a GEMM
    of another shape)."""

    @staticmethod
    def forward(ctx, past: Tensor, own: Tensor, window: Tensor) -> Tensor:
        S, T = past.shape[1], own.shape[1]
        ctx.S = S
        return window[:, : S + T]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[:, : ctx.S], grad[:, ctx.S :], None


def join_latents(past: Tensor, own: Tensor, window: Tensor | None) -> Tensor:
    """``cat([past, own], dim=1)`` ``[B, S + T, R]``: latents of the ``S`` earlier positions and of ``T`` new ones.

    When ``window`` ``[B, >= S + T, R]`` already holds them (the chunked backward's forward sweep computed every
    position's latents, ``DSACache.window``), its first ``S + T`` positions are returned as a view (``_Splice``: no
    copy) and gradients still reach ``past`` and ``own`` as through the concatenation; else a ``torch.cat``."""
    S, T = past.shape[1], own.shape[1]
    if window is not None and window.shape[1] >= S + T:
        return _Splice.apply(past, own, window)
    return torch.cat([past, own], dim=1)


@dataclass
class DSASelection:
    """What the indexer selected for a chunk's queries (shared with the next layer if it is "shared").

    Attributes:
        pools: ``[B, T, K]`` int32 selected pool indices (pool ``p`` = tokens ``p kpool .. p kpool + kpool - 1``),
            descending score, ``-1`` in empty slots.
        pos: ``[T]`` int64 absolute position of each query (its tail depends on it).
        kpool: tokens per pool.
        tail: whether each query also attends to the visible tokens of its incomplete pool.
    """

    pools: Tensor
    pos: Tensor
    kpool: int
    tail: bool

    @property
    def width(self) -> int:
        """Token slots per query: ``K * kpool`` plus ``kpool - 1`` tail slots when the tail is on."""
        return self.pools.shape[-1] * self.kpool + (self.kpool - 1 if self.tail else 0)

    def rows(self, r0: int, r1: int) -> DSASelection:
        """The selection of query rows ``r0 .. r1 - 1``."""
        return DSASelection(self.pools[:, r0:r1], self.pos[r0:r1], self.kpool, self.tail)

    def tokens(self) -> Tensor:
        """Token indices ``[B, T, width]`` int64 (``-1`` in empty slots): the pools expanded, then the tail
        (``Glm5NextTextIndexer.append_visible_tail``)."""
        B, T, K = self.pools.shape
        kp = self.kpool
        p = self.pools.long()
        tok = (p[..., None] * kp + torch.arange(kp, device=p.device)).masked_fill_((p < 0)[..., None], SENTINEL)
        tok = tok.reshape(B, T, K * kp)
        if self.tail and kp > 1:
            pos = self.pos.to(p.device)
            count = (pos + 1) % kp  # visible tokens of the incomplete pool
            off = torch.arange(kp - 1, device=p.device)
            tail = (pos + 1 - count)[:, None] + off
            tail = tail.masked_fill(off[None, :] >= count[:, None], SENTINEL)
            tok = torch.cat([tok, tail.expand(B, T, kp - 1)], dim=-1)
        return tok


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_device(t: Tensor) -> bool:
    """Whether the Triton kernels run on ``t``'s device (CUDA). Tests replace it to run them on CPU under the
    Triton interpreter."""
    return t.is_cuda


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the dtype itself (fp32 stays fp32, fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _index_scores_block(qi: Tensor, wi: Tensor, ki: Tensor) -> Tensor:
    """Indexer scores of a block: ``qi [B,R,H_I,d_I]``, ``wi [B,R,H_I]``, ``ki [B,C,d_I]`` -> ``[B,R,C]``.

    Loops over index heads so that only two ``[B,R,C]`` buffers exist at once (in place when grad is off).
    Differentiable (the indexer warm-up KL uses it); ``indexer_topk`` uses the fused ``_index_scores_tile``.
    """
    acc = None
    kt = ki.transpose(1, 2)  # [B, d_I, C]
    for j in range(qi.shape[2]):
        if torch.is_grad_enabled():
            s = torch.relu(island("dsa.indexer.scores", torch.bmm(qi[:, :, j], kt))) * wi[:, :, j, None]
            acc = s if acc is None else acc + s
        elif acc is None:
            acc = torch.bmm(qi[:, :, j], kt).relu_().mul_(wi[:, :, j, None])
        else:
            s = torch.bmm(qi[:, :, j], kt).relu_().mul_(wi[:, :, j, None])
            acc.add_(s)
            del s
    return acc


def _index_scores_tile(q2: Tensor, w3: Tensor, kt: Tensor, buf: Tensor, out: Tensor) -> Tensor:
    """Scores of one tile without autograd, in preallocated buffers (no allocation in the hot loop).

    ``q2 [R * H_I, d_I]`` (rows of ``[R, H_I, d_I]`` flattened), ``w3 [R, 1, H_I]``, ``kt [d_I, C]``,
    ``buf [>= R * H_I * C]`` and ``out [>= R * C]`` scratch -> ``[R, C]`` view of ``out`` holding
    ``sum_j w[r, j] * ReLU(q[r, j] . k[c])``: one matrix product for all heads, one ReLU pass, one batched
    product that sums the heads.
    """
    R, H = w3.shape[0], w3.shape[2]
    C = kt.shape[1]
    s = torch.mm(q2, kt, out=buf[: R * H * C].view(R * H, C)).relu_()
    return torch.bmm(w3, s.view(R, H, C), out=out[: R * C].view(R, 1, C)).view(R, C)


def _merge_topk(best_v: Tensor, best_i: Tensor, pend_v: list, pend_i: list) -> tuple[Tensor, Tensor]:
    """Running top-k: ``best_v, best_i [R, K]`` and pending candidate pieces ``[R, w_j]`` -> new ``[R, K]``
    (unsorted). Empties the pending lists."""
    v = torch.cat([best_v, *pend_v], dim=-1)
    ci = torch.cat([best_i, *pend_i], dim=-1)
    pend_v.clear()
    pend_i.clear()
    best_v, j = v.topk(best_v.shape[1], dim=-1, sorted=False)
    return best_v, ci.gather(-1, j)


def _pad_rows(rows: Tensor, n_row: Tensor, most: int, vals: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
    """Ragged candidates -> padded rows: ``vals, cols [n]`` of ``rows [n]`` (sorted; ``n_row [R]`` per row, at
    most ``most``) -> ``([R, most]`` values, -inf padded, ``[R, most]`` int64 key positions)."""
    slot = torch.arange(rows.numel(), device=rows.device) - (n_row.cumsum(0) - n_row)[rows]
    cand_v = vals.new_full((n_row.shape[0], most), float("-inf"))
    cand_v[rows, slot] = vals
    cand_i = cols.new_zeros((n_row.shape[0], most))
    cand_i[rows, slot] = cols
    return cand_v, cand_i


def _index_group_max(q3: Tensor, w2: Tensor, kt: Tensor, group: int) -> Tensor:
    """Group maxima of one tile's indexer scores, as elementwise terms that ``torch.compile`` fuses into one loop.

    ``q3 [R, H_I, d_I]``, ``w2 [R, H_I]``, ``kt [d_I, C]`` (fp32, ``C`` a multiple of ``group``) -> ``[R, C / group]``:
    the maximum over each ``group`` columns of ``s[r, c] = sum_j w[r, j] * ReLU(sum_i q[r, j, i] * k[i, c])``
    (``_index_scores_tile``'s math, summed term by term). Compiled (``_index_group_max_compiled``), the scores never
    reach memory: eager's matrix product, ReLU, head sum and group maximum move about forty bytes per score, which
    bounds a CPU at tiny's dims (``bench/eval_long.py``). The unrolled form has ``H_I x d_I`` terms
    (``INDEX_COMPILE_TERMS``).
    """
    acc = None
    for j in range(q3.shape[1]):
        s = q3[:, j, 0, None] * kt[0][None, :]
        for i in range(1, q3.shape[2]):
            s = s + q3[:, j, i, None] * kt[i][None, :]
        s = torch.relu(s) * w2[:, j, None]
        acc = s if acc is None else acc + s
    return acc.view(acc.shape[0], -1, group).amax(-1)


_COMPILED: dict = {}  # "group_max": the compiled _index_group_max, or None once compiling it failed


def _index_group_max_guarded(q3: Tensor, w2: Tensor, kt: Tensor, group: int) -> Tensor:
    """``_index_group_max`` compiled; where compiling fails (no C++ compiler, an inductor error) a warning on stderr,
    once, and the eager products (``_index_scores_tile``, the same math) from then on."""
    fn = _COMPILED.get("group_max")
    if fn is not None:
        try:
            return fn(q3, w2, kt, group)
        except Exception as err:  # noqa: BLE001 -- any compile failure: the eager scores are the same math
            _COMPILED["group_max"] = None
            logging.getLogger("genoctx").warning(
                "indexer_topk: the compiled CPU scorer failed (%s); scoring eagerly", str(err).splitlines()[0]
            )
    R, H, d = q3.shape
    C = kt.shape[1]
    s = _index_scores_tile(q3.reshape(R * H, d), w2.view(R, 1, H), kt, q3.new_empty(R * H * C), q3.new_empty(R * C))
    return s.view(R, C // group, group).amax(-1)


def _index_group_max_compiled(device: torch.device, dtype: torch.dtype, terms: int, pairs: int):
    """The group-maximum scorer ``indexer_topk`` should use for its full query tiles, or ``None`` (eager tiles).

    Compiled for a call on a CPU in fp32 that scores ``pairs >= INDEX_COMPILE_PAIRS`` visible (query, key) pairs with
    at most ``INDEX_COMPILE_TERMS`` index heads x head dims, outside any ``TorchDispatchMode`` (the op counter counts
    the eager ops). CPU only: on CUDA the Triton kernel (``kernels.indexer_topk``) already scores in registers.
    Compiled once per process and shape; inductor's on-disk cache serves later processes.
    """
    if device.type != "cpu" or dtype != torch.float32 or terms > INDEX_COMPILE_TERMS or pairs < INDEX_COMPILE_PAIRS:
        return None
    if _get_current_dispatch_mode() is not None or _COMPILED.get("group_max", True) is None:  # None: compile failed
        return None
    if "group_max" not in _COMPILED:
        _COMPILED["group_max"] = torch.compile(_index_group_max, dynamic=False, fullgraph=True)
    return _index_group_max_guarded


def _grouped_topk(
    group_max,
    q3: Tensor,
    w2: Tensor,
    kt_blocks: Tensor,
    k_rows: Tensor,
    vis: list[int],
    r0: int,
    r1: int,
    lim: Tensor,
    K: int,
    tie_all: Tensor,
) -> tuple[Tensor, Tensor]:
    """One query tile of ``indexer_topk`` from group maxima: the same top-k as ``_running_topk`` in a fixed number
    of ops per tile.

    1. ``group_max`` scores the tile against every block of ``kt_blocks [n_blocks, d_I, C]`` (keys zero-padded to
       whole blocks) and keeps each group's maximum score ``m_G`` (``INDEX_GROUP`` keys): ``[R, groups]``.
    2. Each group bounds the score plus tie-break ``v`` of its keys: ``v <= high = m_G + `` the tie-break of its
       last key, and its best key has ``v >= low = m_G + `` that of its first key (rounding is monotonic). The k-th
       largest ``low`` among the groups a row sees whole, ``theta``, is at most the row's k-th best ``v``, so a key of
       its top-k lies in a group with ``high > theta`` or in one of the k groups ``theta`` came from (a tie at the
       k-th place): about k groups. Exactly equal scores (real DNA gives them in runs) rank by recency through
       ``high`` while the tie-break survives fp32 rounding (scores below about ``key * 2^-17``); above that they tie
       exactly, as in the eager path. With fewer than k whole groups, every group.
    3. Those groups' keys (``k_rows [n_blocks * C, d_I]``) are scored again (two batched products), masked to the
       row's visible keys, and reduced to the top-k.

    ``q3 [R, H_I, d_I]``, ``w2 [R, H_I]``, ``lim [R]`` keys visible to each row (``vis[r0:r1]`` on the host),
    ``tie_all`` each column's tie-break. Returns ``(best_v [R, K]``, ``best_i [R, K]`` int64``)``, unsorted, as
    ``_running_topk``. The bounds hold exactly for step 1's scores; step 3 scores in another order (as do the eager
    tiles), so keys whose scores differ by fp32 rounding may swap, in the selection at the k-th place and in order.
    Autocast must be off (``indexer_topk`` runs without it): step 3's products in bf16 would break the bounds.
    """
    R, g, C = q3.shape[0], INDEX_GROUP, kt_blocks.shape[2]
    n_vis, v0 = vis[r1 - 1], vis[r0]
    n_groups = -(-n_vis // g)  # groups holding a key some row of the tile sees
    parts = [group_max(q3, w2, kt_blocks[i], g) for i in range(-(-n_vis // C))]
    m = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])[:, :n_groups]  # [R, groups]
    whole = v0 // g  # groups every row sees whole
    if whole >= K:
        # bounds on v = score + tie-break in each group: every key's v <= high; the group's best key has v >= low
        high = m + tie_all[g - 1 :: g][:n_groups]
        low = m.add_(tie_all[::g][:n_groups])
        low[:, whole:] = float("-inf")  # theta from the groups every row sees whole
        theta = low.topk(K, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [R, 1]
        first = torch.arange(whole * g, n_groups * g, g, device=m.device)
        high[:, whole:].masked_fill_(first[None, :] >= lim[:, None], float("-inf"))  # groups a row sees no key of
        above = high > theta
        # groups above theta, then the K theta came from (their high may equal it): the top of high there, low else
        n_cand = min(n_groups, int(above.sum(-1).max()) + K)
        grp = torch.where(above, high, low).topk(n_cand, dim=-1, sorted=False).indices  # [R, n_cand]
    else:  # no bound yet: every group
        n_cand = n_groups
        grp = torch.arange(n_groups, device=m.device).expand(R, n_groups)
    cols = (grp[:, :, None] * g + torch.arange(g, device=m.device)).view(R, n_cand * g)
    s = torch.bmm(q3, k_rows[cols].transpose(1, 2)).relu_()  # [R, H_I, n_cand * g]
    s = torch.bmm(w2[:, None, :], s).view(R, n_cand * g)
    s = island("dsa.indexer.scores", s).add_(tie_all[cols]).masked_fill_(cols >= lim[:, None], float("-inf"))
    best_v, j = s.topk(min(K, s.shape[1]), dim=-1, sorted=False)
    best_i = cols.gather(-1, j)
    if best_v.shape[1] < K:
        best_v = torch.cat([best_v, best_v.new_full((R, K - best_v.shape[1]), float("-inf"))], dim=1)
        best_i = torch.cat([best_i, best_i.new_full((R, K - best_i.shape[1]), SENTINEL)], dim=1)
    return best_v, best_i


def _running_topk(
    q2: Tensor,
    w3: Tensor,
    kt: Tensor,
    vis: list[int],
    r0: int,
    r1: int,
    lim: Tensor,
    K: int,
    C: int,
    prune: bool,
    scratch: tuple[Tensor, Tensor, Tensor, Tensor],
) -> tuple[Tensor, Tensor]:
    """One query tile of ``indexer_topk`` (eager): key blocks of ``C`` columns, each scored and merged into a running
    top-k, most recent block first when pruning. ``q2 [Rt * H_I, d_I]``, ``w3 [Rt, 1, H_I]``, ``kt [d_I, n_keys]``,
    ``lim [Rt]`` keys visible to each row (``vis[r0:r1]`` on the host); ``scratch``: score buffers, the key columns
    and their tie-breaks. Returns ``(best_v [Rt, K]`` scores plus tie-breaks, ``-inf`` where empty,
    ``best_i [Rt, K]`` int64 key positions``)``, unsorted."""
    buf, sbuf, cols_all, tie_all = scratch
    Rt, dt, dev, g = r1 - r0, buf.dtype, buf.device, INDEX_GROUP
    n_vis = vis[r1 - 1]  # keys visible to the tile's last row
    best_v = torch.full((Rt, K), float("-inf"), dtype=dt, device=dev)
    best_i = torch.full((Rt, K), SENTINEL, dtype=torch.long, device=dev)
    pend_v, pend_i = [], []  # pruned candidates [Rt, w] waiting for one merged top-k
    starts = list(range(0, n_vis, C))
    for c0 in reversed(starts) if prune else starts:
        c1 = min(n_vis, c0 + C)
        s = island("dsa.indexer.scores", _index_scores_tile(q2, w3, kt[:, c0:c1], buf, sbuf))  # no tie yet
        if c1 > vis[r0]:  # the block reaches past some row's visible keys: causal mask
            s.masked_fill_(cols_all[c0:c1][None, :] >= lim[:, None], float("-inf"))
        thr = best_v.amin(-1, keepdim=True)  # [Rt, 1] k-th best so far (-inf: fewer than K)
        if prune and c1 - c0 == C and bool(torch.isfinite(thr).all()):
            # fl(s + tie) <= fl(max s + largest tie of the block): a group whose bound is not above
            # the threshold cannot enter the top-k (rounding is monotonic, so this is exact)
            tie_max = tie_all[c1 - 1]
            gmax = s.view(Rt, C // g, g).amax(-1).add_(tie_max)  # [Rt, C / g]
            keep = gmax > thr
            most_groups = int(keep.sum(-1).max())  # groups of a row that may enter its top-k
            if most_groups == 0:
                continue
            if most_groups * g * 4 < C:  # few groups survive: look only inside those
                rows, grp = keep.nonzero(as_tuple=True)
                cols = c0 + grp[:, None] * g + torch.arange(g, device=dev)  # [n, g]
                vals = s.view(Rt, C // g, g)[rows, grp].add_(tie_all[cols])
                ii, jj = (vals > thr[rows]).nonzero(as_tuple=True)
                rows, cols, vals = rows[ii], cols[ii, jj], vals[ii, jj]
            else:  # many groups: every key of the block
                rows, col = (s + tie_max > thr).nonzero(as_tuple=True)
                cols = c0 + col
                vals = s[rows, col].add_(tie_all[cols])
            # keys above the row's threshold (rows sorted): pad per row, merge once K are pending
            n_row = torch.bincount(rows, minlength=Rt)
            most = int(n_row.max())
            if most * 4 < C:
                if most:
                    cand_v, cand_i = _pad_rows(rows, n_row, most, vals, cols)
                    pend_v.append(cand_v)
                    pend_i.append(cand_i)
                    if sum(p.shape[1] for p in pend_v) >= K:
                        best_v, best_i = _merge_topk(best_v, best_i, pend_v, pend_i)
                continue
        s.add_(tie_all[c0:c1])  # ties (ReLU zeros) go to the most recent key
        pend_v.append(s)
        pend_i.append(cols_all[c0:c1].expand(Rt, c1 - c0))
        best_v, best_i = _merge_topk(best_v, best_i, pend_v, pend_i)
    if pend_v:
        best_v, best_i = _merge_topk(best_v, best_i, pend_v, pend_i)
    return best_v, best_i


def indexer_topk(
    index_q: Tensor,
    index_w: Tensor,
    index_k: Tensor,
    visible: Tensor,
    topk: int,
    tile_tokens: int,
    index_dtype: torch.dtype = torch.long,
    prune: bool = True,
    *,
    visible_host: list[int] | None = None,
) -> Tensor:
    """Top-k keys (pools) per query by the lightning indexer (DeepSeek-V3.2), in query tiles.

    ``I[t, s] = sum_j index_w[t, j] * ReLU(index_q[t, j] . index_k[s])`` for ``s < visible[t]``, plus
    ``s * TIE_BREAK`` (among equal scores the most recent key wins, whatever the tiling). The DSA layer passes
    pooled keys (``visible[t] = (pos_t + 1) // index_kpool`` complete pools); with pools of one token this is
    DeepSeek-V3.2's per-token indexer (``visible[t] = pos_t + 1``).

    Args:
        index_q: ``[B, T, H_I, d_I]`` indexer queries (any float dtype; scored in at least fp32).
        index_w: ``[B, T, H_I]`` per-head weights (already scaled).
        index_k: ``[B, N, d_I]`` keys (cache first).
        visible: ``[T]`` int64, keys visible to each query row (non-decreasing, in ``[0, N]``).
        topk: keys kept per query (>= 1).
        tile_tokens: score budget: query rows x key columns of one tile (per batch row), at least one row by
            ``INDEX_GROUP`` columns. The tile is at most ``INDEX_ROW_TILE x INDEX_COL_BLOCK`` (sized to stay in
            a CPU core's cache); rows longer than a block are merged by a running top-k.
        index_dtype: dtype of the returned indices: int64 (default) or int32 (half the memory).
        prune: skip key groups that cannot enter a row's top-k. Each row keeps its current k-th best score as
            a threshold; a block's columns are grouped by ``INDEX_GROUP`` and only groups whose maximum
            exceeds the threshold are merged. Blocks are visited from the most recent keys backwards, so the
            threshold rises early. The result equals ``prune=False`` (the plain running top-k), tested, except
            where two keys have exactly equal scores at the k-th place (fp32 scores above ~1 round
            ``TIE_BREAK`` away), where either may be kept. Pruning reads thresholds and candidate counts on the host
            per block: the DSA layer prunes only where that is free (``genoctx.model.host.reads_free``: a CPU).
            A pruned call on a CPU that scores at least ``INDEX_COMPILE_PAIRS`` visible pairs (tiny's indexer at
            256k tokens and beyond) takes its long query tiles from compiled group maxima instead (``_grouped_topk``:
            a fixed number of ops per tile, the scores never in memory): the same keys, except that keys whose
            scores differ by fp32 rounding may swap, at the k-th place and in order (tested).
        visible_host: ``visible``'s values as a host list when the caller has them (the DSA layer computes them from
            its positions); else ``visible`` is read from the device (one host sync: the tiles are steered by it).

    Returns:
        ``idx`` (``index_dtype``) ``[B, T, min(topk, N)]``: selected key positions in descending score order;
        slots beyond a query's visible keys hold ``SENTINEL`` (-1).

    Raises:
        ValueError: ``topk < 1``, ``tile_tokens < 1``, or ``visible`` of the wrong length, decreasing or out of
            range.

    Runs under ``torch.no_grad`` with autocast off. No ``[T, N]`` tensor is materialised: each tile is reduced to
    top-k at once.
    Cost: ``2 H_I d_I`` FLOPs per visible (query, key) pair, quadratic in position as in DeepSeek-V3.2 (divided
    by ``index_kpool`` with pools); ``bench/eval_long.py`` measures it at 1M tokens.
    """
    if topk < 1 or tile_tokens < 1:
        raise ValueError(f"indexer_topk needs topk >= 1 and tile_tokens >= 1, got {topk}, {tile_tokens}")
    B, T, H_I, d_I = index_q.shape
    N = index_k.shape[1]
    vis = list(visible_host) if visible_host is not None else read(visible, label="indexer_topk.visible")
    if len(vis) != T or any(b < a for a, b in zip(vis, vis[1:], strict=False)) or (T and (vis[0] < 0 or vis[-1] > N)):
        raise ValueError(f"indexer_topk: visible must be {T} non-decreasing counts in [0, {N}]")
    if index_dtype not in (torch.long, torch.int32) or (index_dtype == torch.int32 and N >= 2**31):
        raise ValueError(f"indexer_topk: index_dtype must be int64 or int32 (N < 2^31), got {index_dtype}")
    K = min(topk, N)
    dt = _acc_dtype(index_q.dtype)
    dev = index_q.device
    g = INDEX_GROUP
    n_keys = vis[-1] if T else 0  # keys any query of the call may see
    # column block: a multiple of the group, within the budget; row tile: the rest of the budget
    C = max(g, min(INDEX_COL_BLOCK, tile_tokens) // g * g)
    C = max(g, min(C, -(-n_keys // g) * g))
    R = max(1, min(INDEX_ROW_TILE, T, tile_tokens // C))
    out = torch.empty(B, T, K, dtype=index_dtype, device=dev)
    buf = torch.empty(R * H_I * C, dtype=dt, device=dev)
    sbuf = torch.empty(R * C, dtype=dt, device=dev)
    cols_all = torch.arange(n_keys + C, device=dev)
    tie_all = cols_all.to(dt) * TIE_BREAK
    vis_t_all = visible.to(device=dev, dtype=torch.long)
    # the compiled path takes full tiles of R rows only where R is the budget's, not T's: one shape per indexer and
    # budget, not one per short call (dynamo recompiles each shape, up to its limit of 8)
    full_rows = R == max(1, min(INDEX_ROW_TILE, tile_tokens // C))
    grouped = _index_group_max_compiled(dev, dt, H_I * d_I, B * sum(vis)) if prune and full_rows else None
    # no autocast: the tiles pick their own (>= fp32) dtypes, and the grouped tiles' bounds need fp32 rescoring
    with torch.no_grad(), torch.autocast(device_type=dev.type, enabled=False):
        for b in range(B):
            kt = index_k[b, :n_keys].to(dt).t().contiguous()  # [d_I, n_keys]
            if grouped is not None:  # keys zero-padded to whole blocks: as rows, and as contiguous [d_I, C] blocks
                k_rows = index_k.new_zeros(-(-n_keys // C) * C, d_I, dtype=dt)
                k_rows[:n_keys] = index_k[b, :n_keys]
                kt_blocks = k_rows.view(-1, C, d_I).transpose(1, 2).contiguous()
            for r0 in range(0, T, R):
                r1 = min(T, r0 + R)
                Rt = r1 - r0
                q2 = index_q[b, r0:r1].to(dt).reshape(Rt * H_I, d_I)
                w3 = index_w[b, r0:r1].to(dt).reshape(Rt, 1, H_I)
                lim = vis_t_all[r0:r1]  # [Rt] keys visible to each row
                if grouped is not None and Rt == R and vis[r0] >= INDEX_GROUPED_BLOCKS * C:
                    best_v, best_i = _grouped_topk(
                        grouped, q2.view(R, H_I, d_I), w3.view(R, H_I), kt_blocks, k_rows, vis, r0, r1, lim, K, tie_all
                    )
                else:
                    best_v, best_i = _running_topk(
                        q2, w3, kt, vis, r0, r1, lim, K, C, prune, (buf, sbuf, cols_all, tie_all)
                    )
                # descending score; equal scores (fp32 ties the tie-break cannot split) most recent key first
                best_i, j = best_i.sort(dim=-1, descending=True)
                best_v = best_v.gather(-1, j)
                best_v, j = best_v.sort(dim=-1, descending=True, stable=True)
                best_i = best_i.gather(-1, j)
                out[b, r0:r1] = best_i.masked_fill(torch.isneginf(best_v), SENTINEL).to(index_dtype)
    return out


def _visible_pool_pairs(S: int, T: int, kpool: int) -> int:
    """(query, complete pool) pairs visible to the queries at positions ``S .. S + T - 1``:
    ``sum_p (p + 1) // kpool``, in closed form (Python ints: no tensor, no host sync)."""

    def upto(n: int) -> int:  # sum_{m=1..n} m // kpool
        q, r = divmod(n, kpool)
        return kpool * q * (q - 1) // 2 + q * (r + 1)

    return upto(S + T) - upto(S)


def _no_autocast(fn):
    """Run ``fn`` (an autograd Function's forward/backward, or a plain function) with autocast off on the device of
    its first tensor argument: it picks its own (>= fp32) dtypes."""

    def wrapped(*args):
        dev = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        with torch.autocast(device_type=dev, enabled=False):
            return fn(*args)

    return wrapped


def _gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, N, ...]`` gathered at ``idx [B, R, K]`` (entries >= 0) -> ``[B, R, K, ...]``. ``x`` may be a view
    whose rows are not contiguous across the batch (``join_latents``' prefix of a longer window): its rows are
    then gathered in place (no copy of ``x``)."""
    B, N = x.shape[:2]
    if B > 1 and not x.is_contiguous():  # reshape would copy the whole [B, N, ...] on every call
        rows = torch.arange(B, device=x.device).view(B, 1)
        return x[rows, idx.reshape(B, -1)].view(*idx.shape, *x.shape[2:])
    flat = x.reshape(B * N, *x.shape[2:])  # explicit trailing shape: N may be 0 (no complete pool yet)
    off = (torch.arange(B, device=x.device) * N).view(B, 1, 1)
    g = flat.index_select(0, (idx + off).reshape(-1))
    return g.view(*idx.shape, *x.shape[2:])


def _scatter_rows_(acc: Tensor, idx: Tensor, src: Tensor) -> None:
    """``acc [B, N, ...] += src [B, R, K, ...]`` at ``idx [B, R, K]`` (entries >= 0)."""
    B, N = acc.shape[:2]
    off = (torch.arange(B, device=acc.device) * N).view(B, 1, 1)
    rest = acc.shape[2:]  # explicit trailing shape: N and idx may be empty
    acc.view(B * N, *rest).index_add_(0, (idx + off).reshape(-1), src.reshape(idx.numel(), *rest))


def _kl_rows(p: Tensor, logits: Tensor, valid: Tensor) -> Tensor:
    """Sum over rows of ``KL(p || softmax(logits))`` restricted to ``valid``; ``p`` is 0 where invalid."""
    # a row with no valid entry gets finite logits (then weight 0): no NaN in forward or backward
    logits = logits.masked_fill(~valid, float("-inf")).masked_fill(~valid.any(-1, keepdim=True), 0.0)
    logq = island("dsa.indexer.kl", torch.log_softmax(logits, dim=-1))
    logq = logq.masked_fill(~valid, 0.0)
    return (torch.xlogy(p, p) - p * logq).sum()


class _SparseMLARef(torch.autograd.Function):
    """The reference of ``_SparseMLA`` (same call, same numbers up to rounding): tokens expanded per tile with
    ``DSASelection.tokens``, einsum products, masks applied with ``masked_fill``; ~5x the ops per tile. Kept for the
    equality tests."""

    @staticmethod
    @_no_autocast
    def forward(ctx, q, kv, pools, pos, kpool, tail, scale, tile_tokens):
        B, T, H, R = q.shape
        sel = DSASelection(pools, pos, kpool, tail)
        dt = _acc_dtype(q.dtype)
        rows = max(1, tile_tokens // max(1, sel.width))
        o = torch.empty_like(q)
        lse = torch.empty(B, T, H, dtype=dt, device=q.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            it = sel.rows(r0, r1).tokens()  # [B, r, K]
            valid = it >= 0
            ks = _gather_rows(kv, it.clamp_min(0)).to(dt)  # [B, r, K, R]
            s = torch.einsum("brhd,brkd->brhk", q[:, r0:r1].to(dt), ks).mul_(scale)
            s.masked_fill_(~valid[:, :, None, :], float("-inf"))
            m = island("dsa.attn.lse", torch.logsumexp(s, dim=-1))  # [B, r, H]; -inf for a row with nothing selected
            m = m.masked_fill(torch.isneginf(m), 0.0)  # such a row gets p = 0: zero output (SDPA's convention)
            p = s.sub_(m[..., None]).exp_()
            o[:, r0:r1] = torch.einsum("brhk,brkd->brhd", p, ks).to(q.dtype)
            lse[:, r0:r1] = m
        ctx.save_for_backward(q, kv, pools, pos, lse)
        ctx.args = (kpool, tail, scale, rows)
        return o

    @staticmethod
    @_no_autocast
    def backward(ctx, do):
        q, kv, pools, pos, lse = ctx.saved_tensors
        kpool, tail, scale, rows = ctx.args
        sel = DSASelection(pools, pos, kpool, tail)
        B, T, H, R = q.shape
        dt = _acc_dtype(q.dtype)
        dq = torch.empty_like(q)
        dkv = island("dsa.attn.dkv", torch.zeros(kv.shape, dtype=dt, device=kv.device))
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            it = sel.rows(r0, r1).tokens()
            valid = it >= 0
            ic = it.clamp_min(0)
            qt = q[:, r0:r1].to(dt)
            dot = do[:, r0:r1].to(dt)
            ks = _gather_rows(kv, ic).to(dt)  # [B, r, K, R]
            p = torch.einsum("brhd,brkd->brhk", qt, ks).mul_(scale).sub_(lse[:, r0:r1, :, None]).exp_()
            p.masked_fill_(~valid[:, :, None, :], 0.0)
            dp = torch.einsum("brhd,brkd->brhk", dot, ks)
            ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(scale)  # [B, r, H, K]
            dq[:, r0:r1] = torch.einsum("brhk,brkd->brhd", ds, ks).to(q.dtype)
            del ks
            # d latent = (value part) p^T do + (key part) ds^T q; sentinel slots are exact zeros, sent to row 0
            dks = torch.einsum("brhk,brhd->brkd", p, dot).add_(torch.einsum("brhk,brhd->brkd", ds, qt))
            _scatter_rows_(dkv, ic, dks.masked_fill_(~valid[..., None], 0.0))
        return dq, dkv.to(kv.dtype), None, None, None, None, None, None


_FAR = 1 << 62  # token slot of no token (an empty pool, a tail token not yet visible): above every real row


def _flat_rows(x: Tensor) -> tuple[Tensor, int]:
    """``x [B, N, C]`` -> ``(flat [M, C], stride)``: a view over ``x``'s storage whose row ``b stride + n`` is
    ``x[b, n]`` (``M = (B - 1) stride + N``). ``join_latents``' prefix ``window[:, :N]`` of a longer batched window
    is read in place (``stride`` = the window's length); other layouts are made contiguous first."""
    B, N, C = x.shape
    if x.stride(2) != 1 or (N > 1 and x.stride(1) != C) or (B > 1 and (x.stride(0) % C or x.stride(0) < N * C)):
        x = x.contiguous()
    stride = x.stride(0) // C if B > 1 else N
    return x.as_strided(((B - 1) * stride + N, C), (C, 1)), stride


def _slot_base(sel: DSASelection, stride: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """The selection of a whole call as token slots of its ``B T`` flattened query rows, for ``_tile_slots``:
    ``(base [B T, 1, K, 1]`` int64 first flat row (``b stride + p kpool``) of each selected pool, ``_FAR`` for ``-1``;
    ``tail [B T, 1, kpool - 1]`` the flat rows of the query's incomplete pool, ``_FAR`` where not visible, or None
    (tail off or ``kpool == 1``); ``ar [kpool]``). Slots as ``DSASelection.tokens`` (pools, then the tail).
    ``5 + 8 tail + 3 (B > 1)`` ops."""
    B, T, K = sel.pools.shape
    kp = sel.kpool
    p = sel.pools.long()
    ar = torch.arange(kp, device=p.device)
    off = (torch.arange(B, device=p.device) * stride).view(B, 1, 1) if B > 1 else 0
    start = p * kp if B == 1 else p * kp + off
    base = torch.where(p < 0, _FAR, start).view(B * T, 1, K, 1)
    tail = None
    if sel.tail and kp > 1:
        pos = sel.pos.to(p.device)[:, None]  # [T, 1]
        t0 = pos + 1 - (pos + 1) % kp  # first token of the incomplete pool
        tok = t0 + ar[: kp - 1]  # [T, kp - 1]
        tail = torch.where(tok > pos, _FAR, tok if B == 1 else tok + off).view(B * T, 1, kp - 1)
    return base, tail, ar


def _tile_slots(base: Tensor, tail: Tensor | None, ar: Tensor, r0: int, r1: int, last: int) -> tuple[Tensor, Tensor]:
    """Token slots of flattened query rows ``r0 .. r1 - 1`` (``_slot_base``) -> ``(rows [r, 1, W]`` int64 flat rows to
    gather, clamped to ``last`` where empty; ``empty [r, 1, W]`` bool). ``6`` ops (``4`` without tail)."""
    tok = (base[r0:r1] + ar).view(r1 - r0, 1, -1)  # [r, 1, K kp]
    if tail is not None:
        tok = torch.cat([tok, tail[r0:r1]], dim=2)
    empty = tok >= _FAR
    return tok.clamp_max_(last), empty


def _bmm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out = a @ b`` (``[n, i, k] x [n, k, j]``), written into ``out`` (a tile's rows of a preallocated result) by
    one ``bmm`` when the dtypes agree, else computed in ``a``'s dtype and cast (``2`` ops; also under
    ``torch.compile``, whose tracer refuses an ``out=`` view and fuses the copy anyway)."""
    if out.dtype == a.dtype and not torch.compiler.is_compiling():
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))


def _dense_split(width: int, N: int, T: int, H: int, R: int, tile_tokens: int, ratio: float) -> tuple[int, int]:
    """Where sparse attention attends densely: ``(t_split, rows)``. Query rows ``t < t_split`` of a call (``T`` queries
    after ``N - T`` cached positions, ``width`` slots each) see at most ``ratio x width`` keys (``N - T + t + 1``) and
    run as dense tiles of ``rows`` query rows per batch row: a tile's scores and bias, ``rows x n x (H + 1)`` fp32
    with ``n = N - T + t_split`` keys, fit the sparse tile's budget ``tile_tokens x (R + H)`` (``ATTN_TILE_BYTES``).
    ``ratio <= 0``: never (``(0, 1)``). Python ints only (no tensor, no host read)."""
    if ratio <= 0 or width <= 0:
        return 0, 1
    t_split = min(T, max(0, int(ratio * width) - (N - T)))
    if t_split == 0:
        return 0, 1
    return t_split, max(1, tile_tokens * (R + H) // ((N - T + t_split) * (H + 1)))


def _dense_tiles(T: int, t_split: int, rows: int):
    """The dense tiles ``(t0, t1)`` of query rows ``0 .. t_split - 1``."""
    return [(t0, min(t_split, t0 + rows)) for t0 in range(0, t_split, rows)]


def _sparse_tiles(B: int, T: int, t_split: int, rows: int):
    """The sparse tiles ``(r0, r1)`` of flattened query rows ``b T + t`` with ``t >= t_split``, ``rows`` per tile:
    ``range(0, B T, rows)`` when nothing is dense, else per batch row (its rows ``t_split .. T - 1``)."""
    if t_split == 0:
        return [(r0, min(B * T, r0 + rows)) for r0 in range(0, B * T, rows)]
    return [(r0, min((b + 1) * T, r0 + rows)) for b in range(B) for r0 in range(b * T + t_split, (b + 1) * T, rows)]


def _dense_bias(tok: Tensor, t0: int, t1: int, n: int, dtype: torch.dtype) -> Tensor:
    """The selection of query rows ``t0 .. t1 - 1`` as an additive bias over their first ``n`` keys: ``[B, r, n]``,
    0 at the selected tokens (``tok [B, T', W]``, ``DSASelection.tokens``: pools then tail, ``-1`` empty) and
    ``-inf`` elsewhere (one scatter into an extra column that takes the empty slots). ``4`` ops."""
    t = tok[:, t0:t1]
    t = torch.where(t < 0, n, t)
    bias = torch.full((t.shape[0], t1 - t0, n + 1), float("-inf"), dtype=dtype, device=tok.device)
    return bias.scatter_(2, t, 0.0)[..., :n]


def _dense_scores(q: Tensor, kvn: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``scale q . kv + bias``: ``q [B, r, H, R]``, ``kvn [B, n, R]``, ``bias [B, r, n]`` -> ``[B, r, H, n]``
    (one ``bmm``)."""
    B, r, H, R = q.shape
    s = torch.bmm(q.reshape(B, r * H, R), kvn.transpose(1, 2)).view(B, r, H, -1)
    return s.mul_(scale).add_(bias[:, :, None])


def _tile_rows(sel: DSASelection, tile_tokens: int) -> int:
    """Flattened query rows per tile: ``B max(1, tile_tokens // width)`` (``DSASelection.width`` slots per row): the
    tiles of ``_SparseMLARef``, ``B`` batch rows each."""
    return sel.pools.shape[0] * max(1, tile_tokens // max(1, sel.width))


class _SparseMLA(torch.autograd.Function):
    """Softmax attention of every head over its query's selected latents, in tiles of flattened query rows; gathers
    recomputed in backward. Keys and values are the same latent (MLA's absorbed MQA form). Each product is one
    ``bmm``/``baddbmm`` on 3-D views; empty slots enter as an additive ``-inf`` bias (``baddbmm``), get ``p = 0``
    and exact zero gradients (scattered, as zeros, to a clamped row). Reference: ``_SparseMLARef``.

    Ops (fp32, one process): forward ``5 + base + t (17 + slots)``, backward ``7 + base + t (31 + slots)``, with
    ``t`` tiles, ``base`` = ``_slot_base``'s and ``slots`` = ``_tile_slots``' (``op_counts``)."""

    @staticmethod
    @_no_autocast
    def forward(ctx, q, kv, pools, pos, kpool, tail, scale, tile_tokens, dense_ratio=0.0):
        B, T, H, R = q.shape
        sel = DSASelection(pools, pos, kpool, tail)
        dt = _acc_dtype(q.dtype)
        t_split, drows = _dense_split(sel.width, kv.shape[1], T, H, R, tile_tokens, dense_ratio)
        kvf, stride = _flat_rows(kv)
        base, tl, ar = _slot_base(sel, stride)
        q3 = q.view(B * T, H, R) if q.is_contiguous() else q.reshape(B * T, H, R)
        inf, zero = torch.full((), float("-inf"), dtype=dt, device=q.device), torch.zeros((), dtype=dt, device=q.device)
        rows = _tile_rows(sel, tile_tokens)
        # contiguous, not empty_like: q may be a permuted view, and a bmm(out=) into strided rows loops per row
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        o3, lse = o.view(B * T, H, R), torch.empty(B * T, H, 1, dtype=dt, device=q.device)
        if t_split:  # short windows: dense tiles over all visible keys, the selection as a bias (no gather)
            tok, lse4, N0 = sel.rows(0, t_split).tokens(), lse.view(B, T, H, 1), kv.shape[1] - T
            for t0, t1 in _dense_tiles(T, t_split, drows):
                n = N0 + t1
                kvn = kv[:, :n].to(dt)
                s = _dense_scores(q[:, t0:t1].to(dt), kvn, _dense_bias(tok, t0, t1, n, dt), scale)  # [B, r, H, n]
                m = torch.logsumexp(s, dim=-1, keepdim=True)
                m = island("dsa.attn.lse", m.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0))
                lse4[:, t0:t1] = m
                ot = torch.bmm(s.sub_(m).exp_().view(B, -1, n), kvn)  # [B, r H, R]
                o[:, t0:t1] = ot.view(B, t1 - t0, H, R)
        for r0, r1 in _sparse_tiles(B, T, t_split, rows):
            idx, empty = _tile_slots(base, tl, ar, r0, r1, kvf.shape[0] - 1)
            ks = kvf.index_select(0, idx.view(-1)).view(r1 - r0, idx.shape[2], R).to(dt)  # [r, W, R]
            bias = torch.where(empty, inf, zero)  # [r, 1, W]
            s = torch.baddbmm(bias, q3[r0:r1].to(dt), ks.transpose(1, 2), alpha=scale)  # [r, H, W]
            m = torch.logsumexp(s, dim=-1, keepdim=True, out=lse[r0:r1])  # -inf: a row with nothing selected
            m = island("dsa.attn.lse", m.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0))  # p = 0, o = 0
            _bmm_into(o3[r0:r1], s.sub_(m).exp_(), ks)
        ctx.save_for_backward(q, kv, pools, pos, lse.view(B, T, H))
        ctx.args = (kpool, tail, scale, tile_tokens, dense_ratio)
        return o

    @staticmethod
    @_no_autocast
    def backward(ctx, do):
        q, kv, pools, pos, lse = ctx.saved_tensors
        kpool, tail, scale, tile_tokens, dense_ratio = ctx.args
        sel = DSASelection(pools, pos, kpool, tail)
        B, T, H, R = q.shape
        N = kv.shape[1]
        t_split, drows = _dense_split(sel.width, N, T, H, R, tile_tokens, dense_ratio)
        dt = _acc_dtype(q.dtype)
        kvf, stride = _flat_rows(kv)
        base, tl, ar = _slot_base(sel, stride)
        q3, do3 = q.reshape(B * T, H, R), do.reshape(B * T, H, R)
        lse3 = lse.view(B * T, H, 1)
        inf, zero = torch.full((), float("-inf"), dtype=dt, device=q.device), torch.zeros((), dtype=dt, device=q.device)
        dkv = island("dsa.attn.dkv", torch.zeros(kv.shape, dtype=dt, device=kv.device))
        dkvf = dkv.view(B * N, R)
        rows = _tile_rows(sel, tile_tokens)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as forward's o
        dq3 = dq.view(B * T, H, R)
        if t_split:  # dense tiles (forward's): dq = ds kv, dkv = p^T do + ds^T q as matmuls, no scatter
            tok = sel.rows(0, t_split).tokens()
            for t0, t1 in _dense_tiles(T, t_split, drows):
                n, r = N - T + t1, t1 - t0
                kvn = kv[:, :n].to(dt)
                qt, dot = q[:, t0:t1].to(dt), do[:, t0:t1].to(dt).reshape(B, r * H, R)
                p = _dense_scores(qt, kvn, _dense_bias(tok, t0, t1, n, dt), scale).sub_(lse[:, t0:t1, :, None]).exp_()
                dp = torch.bmm(dot, kvn.transpose(1, 2)).view(B, r, H, n)
                ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(scale).view(B, r * H, n)  # dL/ds
                dq[:, t0:t1] = torch.bmm(ds, kvn).view(B, r, H, R)
                dkn = torch.bmm(p.view(B, r * H, n).transpose(1, 2), dot)  # [B, n, R]
                torch.baddbmm(dkn, ds.transpose(1, 2), qt.reshape(B, r * H, R), out=dkn)
                dkv[:, :n].add_(dkn)
        for r0, r1 in _sparse_tiles(B, T, t_split, rows):
            idx, empty = _tile_slots(base, tl, ar, r0, r1, kvf.shape[0] - 1)
            ks = kvf.index_select(0, idx.view(-1)).view(r1 - r0, idx.shape[2], R).to(dt)  # [r, W, R]
            kt = ks.transpose(1, 2)
            qt, dot = q3[r0:r1].to(dt), do3[r0:r1].to(dt)
            bias = torch.where(empty, inf, zero)
            p = torch.baddbmm(bias, qt, kt, alpha=scale).sub_(lse3[r0:r1]).exp_()  # [r, H, W]; 0 at empty slots
            dp = torch.bmm(dot, kt)
            ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p)  # dL/ds / scale; 0 at empty slots (scaled below)
            _bmm_into(dq3[r0:r1], ds.mul_(scale), ks)  # dL/ds
            del ks, kt
            # d latent = (value part) p^T do + (key part) ds^T q; empty slots are exact zeros, sent to a row
            dks = torch.bmm(p.transpose(1, 2), dot)  # [r, W, R]
            torch.baddbmm(dks, ds.transpose(1, 2), qt, out=dks)  # not baddbmm_: FlopCounterMode counts this one
            if stride != N:  # kv read in place from a longer window: flat row b stride + n -> b N + n
                idx = idx - idx.div(stride, rounding_mode="floor") * (stride - N)
            dkvf.index_add_(0, idx.view(-1), dks.view(-1, R))
        return dq, dkv.to(kv.dtype), None, None, None, None, None, None, None


def sparse_mla(
    q: Tensor, kv: Tensor, sel: DSASelection, scale: float, tile_tokens: int = ATTN_TILE_TOKENS,
    dense_ratio: float = DENSE_RATIO,
) -> Tensor:  # fmt: skip
    """Attention of each query over its selected tokens only, MLA in absorbed MQA form (DeepSeek-V3.2 sparse MLA).

    ``o[t, h] = sum_{s in sel(t)} softmax_s(scale * q[t, h] . kv[s]) kv[s]``; a query with nothing selected
    gets ``o = 0`` (the reference's SDPA behaviour for a fully masked row).

    Args:
        q: ``[B, T, H, R]`` queries mapped into the latent (``q W_UK``).
        kv: ``[B, N, R]`` latents of all positions (cache first).
        sel: the selection of the ``T`` queries (``DSASelection``; token indices < N).
        scale: logit scale (``qk_head_dim ** -0.5``).
        tile_tokens: query-tile rows x selected tokens handled at once (memory knob).
        dense_ratio: query rows that see at most ``dense_ratio x sel.width`` keys attend to all of them at once with
            the selection as a 0/-inf bias (same numbers up to rounding, no gather; ``_dense_split``); 0: never.

    Returns:
        ``o [B, T, H, R]`` in ``q``'s dtype (computed in at least fp32).

    Differentiable w.r.t. ``q`` and ``kv`` (including cached latents). Saves q, kv, the pool indices and the
    per-row logsumexp; gathered latents are recomputed per tile in backward and gradients accumulated with
    ``index_add_`` skipping sentinels. Memory O(T x top-k), never O(T^2).

    Raises:
        ValueError: shapes that do not fit.
    """
    B, T, H, R = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != R or sel.pools.shape[:2] != (B, T):
        raise ValueError(
            f"sparse_mla: bad shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, pools {tuple(sel.pools.shape)}"
        )
    return _SparseMLA.apply(
        q, kv, sel.pools, sel.pos, sel.kpool, sel.tail, float(scale), int(tile_tokens), float(dense_ratio)
    )


def _pool_target(p_tok: Tensor, n_pools: int, kpool: int) -> Tensor:
    """Attention mass per pool: ``p_tok [..., >= n_pools * kpool]`` (first ``n_pools * kpool`` slots are the pools'
    tokens in order) -> ``[..., n_pools]``."""
    return p_tok[..., : n_pools * kpool].unflatten(-1, (n_pools, kpool)).sum(-1)


class _IndexerKLSparseRef(torch.autograd.Function):
    """The reference of ``_IndexerKLSparse`` (same call, same numbers up to rounding), per-tile token expansion and
    einsum products as ``_SparseMLARef``. Kept for the equality tests.

    Indexer KL of the sparse stage over the selected pools, summed over queries, with its gradients computed
    in the same pass.

    Per query tile: target ``p`` = the main attention (heads summed) over the attended tokens, summed per
    selected pool and renormalised over them (no grad); ``l = sum_j w_j ReLU(q_I_j . K_pool)``;
    ``KL(p || softmax(l))``, whose gradient w.r.t. ``l`` is ``softmax(l) - p``, pushed through the ReLU scores
    to ``index_q``, ``index_w`` and the pooled keys (scattered with ``index_add_``). Rows with no selected pool
    contribute nothing. Backward only scales the stored gradients.
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, iq, iw, pk, q, kv, pools, pos, kpool, tail, scale, rows):
        B, T, H, R = q.shape
        sel = DSASelection(pools, pos, kpool, tail)
        Kp = pools.shape[-1]
        dt = _acc_dtype(iq.dtype)
        diq = torch.zeros(iq.shape, dtype=dt, device=iq.device)
        diw = torch.zeros(iw.shape, dtype=dt, device=iw.device)
        dpk = torch.zeros(pk.shape, dtype=dt, device=pk.device)
        total = torch.zeros((), dtype=dt, device=iq.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            st = sel.rows(r0, r1)
            it = st.tokens()
            tv = it >= 0
            ks = _gather_rows(kv, it.clamp_min(0)).to(_acc_dtype(q.dtype))
            sa = island("dsa.indexer.kl", torch.einsum("brhd,brkd->brhk", q[:, r0:r1].to(ks.dtype), ks)).mul_(scale)
            del ks
            sa.masked_fill_(~tv[:, :, None, :], float("-inf"))
            pt = torch.nan_to_num(torch.softmax(sa, dim=-1)).sum(2)  # [B, r, K_tok]
            del sa
            pt = _pool_target(pt, Kp, kpool).to(dt)  # [B, r, Kp]
            pv = st.pools >= 0
            z = pt.sum(-1, keepdim=True)
            ok = pv.any(-1, keepdim=True) & (z > 0)  # rows with a target
            pt = torch.where(ok, pt / z.clamp_min(torch.finfo(dt).tiny), 0.0)
            valid = pv & ok
            pc = st.pools.long().clamp_min(0)
            pks = _gather_rows(pk, pc).to(dt)  # [B, r, Kp, d_I]
            qi, wi = iq[:, r0:r1].to(dt), iw[:, r0:r1].to(dt)
            a = torch.einsum("brjd,brkd->brjk", qi, pks)  # [B, r, H_I, Kp]
            rl = torch.relu(a)
            logits = (rl * wi[..., None]).sum(2).masked_fill_(~valid, float("-inf"))
            logq = island("dsa.indexer.kl", torch.log_softmax(logits, dim=-1)).masked_fill_(~valid, 0.0)
            total += (torch.xlogy(pt, pt) - pt * logq).sum()
            g = (logq.exp_() - pt).masked_fill_(~valid, 0.0)  # dKL/dlogits
            diw[:, r0:r1] = torch.einsum("brk,brjk->brj", g, rl)
            da = (a > 0).to(dt).mul_(g[:, :, None, :]).mul_(wi[..., None])  # [B, r, H_I, Kp]
            diq[:, r0:r1] = torch.einsum("brjk,brkd->brjd", da, pks)
            _scatter_rows_(dpk, pc, torch.einsum("brjk,brjd->brkd", da, qi))  # empty slots carry zeros
        ctx.save_for_backward(diq, diw, dpk)
        ctx.dtypes = (iq.dtype, iw.dtype, pk.dtype)
        return total

    @staticmethod
    def backward(ctx, gout):
        diq, diw, dpk = ctx.saved_tensors
        tq, tw, tk = ctx.dtypes
        return (gout * diq).to(tq), (gout * diw).to(tw), (gout * dpk).to(tk), *([None] * 8)


class _IndexerKLSparse(torch.autograd.Function):
    """Indexer KL of the sparse stage over the selected pools, summed over queries, with its gradients computed
    in the same pass; tiles of flattened query rows as ``_SparseMLA`` (same slots, same products as one
    ``bmm``/``baddbmm`` each). Reference: ``_IndexerKLSparseRef``.

    Per query tile: target ``p`` = the main attention (heads summed) over the attended tokens, summed per
    selected pool and renormalised over them (no grad); ``l = sum_j w_j ReLU(q_I_j . K_pool)``;
    ``KL(p || softmax(l))``, whose gradient w.r.t. ``l`` is ``softmax(l) - p``, pushed through the ReLU scores
    to ``index_q``, ``index_w`` and the pooled keys (scattered with ``index_add_``). Rows with no selected pool
    contribute nothing. Backward only scales the stored gradients.

    Ops (fp32, one process): forward ``10 + base + t (46 + slots)`` (``_SparseMLA``'s notation), backward ``3``
    (plus a cast per gradient whose dtype is not the compute dtype).
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, iq, iw, pk, q, kv, pools, pos, kpool, tail, scale, tile_tokens, dense_ratio=0.0):
        B, T, H, R = q.shape
        _, _, HI, dI = iq.shape
        sel = DSASelection(pools, pos, kpool, tail)
        Kp = pools.shape[-1]
        dt, da = _acc_dtype(iq.dtype), _acc_dtype(q.dtype)
        kvf, stride = _flat_rows(kv)
        base, tl, ar = _slot_base(sel, stride)
        P = pk.shape[1]
        pkf = pk.reshape(B * P, dI)
        pp = pools.long()  # selected pools, and their flat rows in pk
        pinv = (pp < 0).view(B * T, Kp)
        pc = pp.clamp_min(0)
        if B > 1:
            pc = pc + (torch.arange(B, device=pk.device) * P).view(B, 1, 1)
        pc = pc.view(B * T, Kp)
        q3 = q.reshape(B * T, H, R)
        iq3, iw3 = iq.reshape(B * T, HI, dI), iw.reshape(B * T, 1, HI)
        inf, zero = torch.full((), float("-inf"), dtype=da, device=q.device), torch.zeros((), dtype=da, device=q.device)
        dpk = torch.zeros(B * P, dI, dtype=dt, device=pk.device)
        rows = _tile_rows(sel, tile_tokens)
        diq = torch.empty(B * T, HI, dI, dtype=dt, device=iq.device)
        diw = torch.empty(B * T, HI, 1, dtype=dt, device=iw.device)
        total = torch.zeros((), dtype=dt, device=iq.device)

        def indexer_tile(r0: int, r1: int, pt: Tensor) -> None:
            """The KL of flattened query rows ``r0 .. r1 - 1`` against their target ``pt [r, Kp]`` (attention mass
            per selected pool, 0 in empty slots), its gradients written/added into diq, diw, dpk."""
            r = r1 - r0
            z = pt.sum(-1, keepdim=True)
            inv = pinv[r0:r1] | (z <= 0)  # slots with no target: empty, or a row whose pools got no mass
            pt = pt.div_(z.clamp_min_(torch.finfo(dt).tiny))  # rows with no mass stay 0
            pidx = pc[r0:r1].reshape(-1)
            pks = pkf.index_select(0, pidx).view(r, Kp, dI).to(dt)  # [r, Kp, d_I]
            qi, wi = iq3[r0:r1].to(dt), iw3[r0:r1].to(dt)
            a = torch.bmm(qi, pks.transpose(1, 2))  # [r, H_I, Kp]
            rl = torch.relu(a)
            logits = torch.bmm(wi, rl).view(r, Kp).masked_fill_(inv, float("-inf"))
            logq = island("dsa.indexer.kl", torch.log_softmax(logits, dim=-1)).masked_fill_(inv, 0.0)
            total.add_(torch.xlogy(pt, pt).sub_(pt * logq).sum())
            g = logq.exp_().sub_(pt).masked_fill_(inv, 0.0).view(r, Kp, 1)  # dKL/dlogits
            torch.bmm(rl, g, out=diw[r0:r1])  # [r, H_I, 1]
            dA = (g.view(r, 1, Kp) * wi.view(r, HI, 1)).mul_(a > 0)  # [r, H_I, Kp]
            torch.bmm(dA, pks, out=diq[r0:r1])
            dpk.index_add_(0, pidx, torch.bmm(dA.transpose(1, 2), qi).view(-1, dI))  # empty slots carry zeros

        t_split, drows = _dense_split(sel.width, kv.shape[1], T, H, R, tile_tokens, dense_ratio)
        if t_split:  # short windows: the target from dense tiles over all visible keys (as _SparseMLA's), no gather
            tok, N0, pvt = sel.rows(0, t_split).tokens(), kv.shape[1] - T, pools[:, :t_split].long()
            for t0, t1 in _dense_tiles(T, t_split, drows):
                n, r = N0 + t1, t1 - t0
                sa = _dense_scores(q[:, t0:t1].to(da), kv[:, :n].to(da), _dense_bias(tok, t0, t1, n, da), scale)
                pt = torch.nan_to_num(torch.softmax(island("dsa.indexer.kl", sa), dim=-1)).sum(2)  # [B, r, n]
                del sa
                Pn = n // kpool  # complete pools visible to the tile; a selected pool's slots hold its tokens' mass
                if Pn and Kp:
                    pt = pt[..., : Pn * kpool].unflatten(-1, (Pn, kpool)).sum(-1).to(dt)  # [B, r, P]
                    pt = pt.gather(2, pvt[:, t0:t1].clamp_min(0)).masked_fill_(pvt[:, t0:t1] < 0, 0.0)  # [B, r, Kp]
                else:
                    pt = torch.zeros(B, r, Kp, dtype=dt, device=q.device)
                for b in range(B):
                    indexer_tile(b * T + t0, b * T + t1, pt[b])
        for r0, r1 in _sparse_tiles(B, T, t_split, rows):
            r = r1 - r0
            idx, empty = _tile_slots(base, tl, ar, r0, r1, kvf.shape[0] - 1)
            ks = kvf.index_select(0, idx.view(-1)).view(r, idx.shape[2], R).to(da)  # [r, W, R]
            bias = torch.where(empty, inf, zero)
            sa = torch.baddbmm(bias, q3[r0:r1].to(da), ks.transpose(1, 2), alpha=scale)  # [r, H, W]
            del ks
            pt = torch.nan_to_num(torch.softmax(island("dsa.indexer.kl", sa), dim=-1))  # rows with nothing: 0
            del sa
            pt = pt[..., : Kp * kpool].unflatten(-1, (Kp, kpool)).sum((1, 3)).to(dt)  # [r, Kp] per pool, heads summed
            indexer_tile(r0, r1, pt)
        ctx.save_for_backward(diq.view(iq.shape), diw.view(iw.shape), dpk.view(pk.shape))
        ctx.dtypes = (iq.dtype, iw.dtype, pk.dtype)
        return total

    @staticmethod
    def backward(ctx, gout):
        diq, diw, dpk = ctx.saved_tensors
        tq, tw, tk = ctx.dtypes
        return (gout * diq).to(tq), (gout * diw).to(tw), (gout * dpk).to(tk), *([None] * 9)


@_no_autocast
def _kl_warmup_tile(q, kv, pos, iq, iw, pk, kpool, scale, n):
    """Indexer KL of one query tile, warm-up stage: target = dense attention (heads summed) over all visible
    tokens, summed per visible complete pool and renormalised; model = softmax over those pools. Computed in at
    least fp32 with autocast off (its products would otherwise run in bf16 under autocast). ``n``: tokens visible to
    the tile's last row (``pos[-1] + 1``, known on the host)."""
    B, R, H, _ = q.shape
    P = n // kpool
    dev = q.device
    dt = _acc_dtype(iq.dtype)
    vis_pool = torch.arange(P, device=dev)[None, :] < ((pos + 1) // kpool)[:, None]  # [R, P]
    with torch.no_grad():
        kd = kv[:, :n].to(_acc_dtype(q.dtype))
        s = island("dsa.indexer.kl", torch.einsum("brhd,bnd->brhn", q.to(kd.dtype), kd)) * scale  # the target's
        causal = torch.arange(n, device=dev)[None, :] <= pos[:, None]  # [R, n]
        s.masked_fill_(~causal[None, :, None, :], float("-inf"))
        p = _pool_target(torch.softmax(s, dim=-1).sum(2), P, kpool).to(dt)  # [B, R, P]
        p = p.masked_fill(~vis_pool[None], 0.0)
        z = p.sum(-1, keepdim=True)
        ok = vis_pool.any(-1)[None, :, None] & (z > 0)
        p = torch.where(ok, p / z.clamp_min(torch.finfo(dt).tiny), 0.0)
    valid = vis_pool[None].expand(B, R, P) & ok
    logits = _index_scores_block(iq.to(dt), iw.to(dt), pk[:, :P].to(dt))
    return _kl_rows(p, logits, valid)


class Indexer(nn.Module):
    """The KPool lightning indexer (``Glm5NextTextIndexer``): parameter names and shapes as the reference.

    ``wq_b`` [H_I d_I, q_lora_rank], ``wk`` [d_I, D], ``k_norm`` (LayerNorm, eps 1e-6, weight and bias),
    ``weights_proj`` [H_I, D], ``index_kpool_compress_ape`` [kpool, d_I], ``index_kpool_compress_gate``
    [d_I, D].
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, HI, dI, kp = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        self.n_heads, self.head_dim, self.kpool = HI, dI, kp
        self.wq_b = nn.Linear(cfg.q_lora_rank, HI * dI, bias=False)
        self.wk = nn.Linear(D, dI, bias=False)
        self.k_norm = nn.LayerNorm(dI, eps=1e-6)
        self.weights_proj = nn.Linear(D, HI, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kp, dI))
        # The reference initialises the gate to ones (sharp pooling by sum(x)); from scratch genoctx draws it
        # N(0, init_std): pooling starts near the mean of the pool's keys. Loaded checkpoints bring their own.
        self.index_kpool_compress_gate = nn.Parameter(torch.randn(dI, D) * cfg.initializer_range)
        for lin in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(lin.weight, std=cfg.initializer_range)

    def keys(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Token keys ``LayerNorm(wk x)`` and compress-gate logits ``x gate^T``: x ``[B, T, D]`` -> two
        ``[B, T, d_I]`` in x's compute dtype. The LayerNorm is an fp32 island (fp64 for fp64 input), autocast off,
        its output cast back as ``RMSNorm``'s is (CUDA autocast would return fp32 keys, CPU autocast would
        normalise in bf16)."""
        k = self.wk(x)
        ln = self.k_norm
        with torch.autocast(device_type=x.device.type, enabled=False):
            ct = _acc_dtype(k.dtype)
            kn = F.layer_norm(k.to(ct), ln.normalized_shape, ln.weight.to(ct), ln.bias.to(ct), ln.eps)
        return island("norm.indexer_k", kn).to(k.dtype), F.linear(x, self.index_kpool_compress_gate)

    def queries(self, x: Tensor, q_resid: Tensor) -> tuple[Tensor, Tensor]:
        """Queries ``wq_b(q_resid)`` ``[B, T, H_I, d_I]`` and head weights ``weights_proj(x) H_I^-1/2 d_I^-1/2``
        ``[B, T, H_I]`` (the reference's softmax scale ``d_I^-1/2`` moved out of the ReLU: it is positive)."""
        B, T, _ = x.shape
        q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim)
        w = self.weights_proj(x) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, w

    def pool(self, k: Tensor, gate: Tensor) -> Tensor:
        """Pool keys of complete pools (``get_pooled_states``): ``k, gate [B, P kpool, d_I]`` -> ``[B, P, d_I]``
        fp32 (fp64 for fp64 keys), ``sum_i softmax_i(gate_i + ape_i) k_i`` per channel, softmax and sum in fp32: the
        pooled keys are kept for every later chunk, whose indexer-KL gradients they sum (``genoctx.train.chunked``)."""
        B, n, dI = k.shape
        P = n // self.kpool
        ct = _acc_dtype(k.dtype)  # fp32 (fp64 for an fp64 model)
        with torch.autocast(device_type=k.device.type, enabled=False):
            logits = gate.view(B, P, self.kpool, dI).to(ct) + self.index_kpool_compress_ape.to(ct)
            prob = torch.softmax(logits, dim=2)  # [B, P, kpool, d_I] fp32, times k promotes: no fp32 copy of k kept
            return island("dsa.indexer.pool", (prob * k.view(B, P, self.kpool, dI)).sum(2))

    def extend(self, cache: DSACache | None, k: Tensor, gate: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Pooled keys of every complete pool up to the end of this chunk, and the new incomplete tail.

        Args:
            cache: the previous chunk's cache (its ``pool_k``, ``tail_k``, ``tail_gate``), or None.
            k, gate: this chunk's token keys and gate logits ``[B, T, d_I]``.

        Returns:
            ``(pool_k [B, (S + T) // kpool, d_I], tail_k, tail_gate [B, (S + T) % kpool, d_I])``.
        """
        if cache is not None and cache.pool_k is not None:
            k = torch.cat([cache.tail_k, k], dim=1)
            gate = torch.cat([cache.tail_gate, gate], dim=1)
        n = k.shape[1] // self.kpool * self.kpool
        new = self.pool(k[:, :n], gate[:, :n])
        pool_k = new if cache is None or cache.pool_k is None else torch.cat([cache.pool_k, new], dim=1)
        # the tail copied (< kpool rows): a view would keep the whole chunk's keys alive with the cache
        return pool_k, k[:, n:].clone(), gate[:, n:].clone()


class DeepSeekSparseAttention(nn.Module):
    """DSA mixing layer (``Glm5NextTextAttention``): NoPE MLA plus, on "full" layers, the KPool indexer.

    Parameters (reference names): ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` and ``indexer`` (None on "shared" layers).

    Args:
        cfg: the architecture (MLA widths, indexer fields) and ``indexer_tile_tokens``, ``dsa_mode``,
            ``indexer_stage``, ``indexer_loss_coef``.
        layer_idx: the layer's index (its ``indexer_types`` entry).

    After each ``forward``: ``self.stats = {"path", "kernel", "indexer", "keys_scored", "keys_attended",
    "indexer_loss"}`` (``kernel`` = "triton" when the Triton indexer top-k / sparse attention ran, else "torch";
    ``keys_scored`` = (query, pool) pairs the indexer scored; ``keys_attended`` = (query, token) pairs attended)
    and ``self.aux_loss`` (indexer KL x ``indexer_loss_coef``; None for stage "off", shared layers or no grad).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.qk_head_dim, self.v_head_dim = H, cfg.qk_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.kpool, self.tail = cfg.index_kpool, cfg.index_kpool_always_select_tail
        self.topk, self.tile_tokens = cfg.index_topk, cfg.indexer_tile_tokens
        self.mode, self.stage, self.loss_coef = cfg.dsa_mode, cfg.indexer_stage, cfg.indexer_loss_coef
        self.kernels = cfg.kernels
        self.attn_tile_tokens = attn_tile_tokens(cfg.kv_lora_rank, H)  # tiles sized in bytes (ATTN_TILE_BYTES)
        self.scale = self.qk_head_dim**-0.5
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, D, bias=bias)
        for lin in (self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=cfg.initializer_range)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.shared = cfg.indexer_types[layer_idx] == "shared"
        self.indexer = None if self.shared else Indexer(cfg)
        self.stats: dict = {}
        self.aux_loss: Tensor | None = None
        # the chunked step's selection memo (genoctx.train.chunked): None, or {(S, T): pools [B, T, K] int32} that
        # ``forward`` fills with each chunk's top-k and reuses when the same chunk runs again (module docstring)
        self.selection_memo: dict[tuple[int, int], Tensor] | None = None

    def absorbed(self) -> tuple[Tensor, Tensor]:
        """``(W_UK [H, qk_head_dim, R], W_UV [H, v_head_dim, R])``, views of ``kv_b_proj.weight`` (of its
        ``merged_weight()`` ``W + s B A`` when it carries a LoRA adapter, ``genoctx.model.lora``)."""
        lin = self.kv_b_proj
        W = (lin.merged_weight() if hasattr(lin, "merged_weight") else lin.weight).view(
            self.n_heads, self.qk_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return W[:, : self.qk_head_dim], W[:, self.qk_head_dim :]

    def latent(self, x: Tensor) -> Tensor:
        """The normalised MLA latent ``kv_a_layernorm(kv_a_proj_with_mqa x)``: ``[B, T, D]`` -> ``[B, T, R]``."""
        return self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))

    def cache_of(self, latent: Tensor, index_k: Tensor | None, index_gate: Tensor | None) -> DSACache:
        """The cache after the tokens whose latents and (for a full layer) indexer token keys/gates are given,
        ``[B, S, .]`` each (context parallelism builds the caches of earlier pieces with it)."""
        if self.indexer is None:
            return DSACache(latent)
        pool_k, tail_k, tail_gate = self.indexer.extend(None, index_k, index_gate)
        return DSACache(latent, pool_k, tail_k, tail_gate)

    def forward(
        self, x: Tensor, cache: DSACache | None = None, selection: DSASelection | None = None
    ) -> tuple[Tensor, DSACache, DSASelection | None]:
        """One chunk: ``x [B, T, D]``, the cache of the ``S`` earlier positions and, on a "shared" layer, the
        selection of the full layer before it -> ``(y [B, T, D], cache of S + T positions, this chunk's
        selection (None in dense mode))``.

        Raises:
            ValueError: a shared layer in sparse mode without a selection, or a selection of the wrong shape.
        """
        B, T, _ = x.shape
        H = self.n_heads
        S = cache.length if cache is not None else 0
        pos = torch.arange(S, S + T, device=x.device)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, T, H, self.qk_head_dim)
        c = self.latent(x)
        latent = c if cache is None or S == 0 else join_latents(cache.latent, c, cache.window)
        W_UK, W_UV = self.absorbed()
        q_abs = torch.einsum("bthd,hdr->bthr", q, W_UK)
        iq = iw = pool_k = None
        new_cache = DSACache(latent)
        if self.indexer is not None:  # indexer inputs detached: it learns only from its KL
            xd = x.detach()
            ik, ig = self.indexer.keys(xd)
            pool_k, tail_k, tail_gate = self.indexer.extend(cache if S else None, ik, ig)
            new_cache = DSACache(latent, pool_k, tail_k, tail_gate)
            iq, iw = self.indexer.queries(xd, q_resid.detach())
        kp = self.kpool
        n_vis_pools = (pos + 1) // kp
        scored = B * _visible_pool_pairs(S, T, kp) if self.indexer is not None else 0
        sel = None
        need_sel = self.mode == "sparse" or (self.stage == "sparse" and torch.is_grad_enabled())
        use_triton = self.kernels == "triton" and all(
            _kernel_device(t) and t.dtype in _KERNEL_DTYPES for t in (q_abs, latent, iq, iw, pool_k) if t is not None
        )
        # compiled (train.compile): the top-k as one opaque op (it steers its tiles from the host: no graph break)
        topk_fn, attn_fn = (indexer_topk_op if torch.compiler.is_compiling() else indexer_topk), sparse_mla
        if use_triton:  # imported here: a CPU install needs no working Triton
            from kernels.indexer_topk import indexer_topk as topk_fn
            from kernels.sparse_mla import sparse_mla as attn_fn
        ran_triton = False
        if self.indexer is not None and need_sel:
            K = min(self.topk // kp, pool_k.shape[1])
            if K > 0:
                # visible pools of each query on the host (from the positions, no device read); the PyTorch top-k prunes
                # by per-block host reads only where they are free (a CPU)
                kw = {}  # compiled: the opaque op (it reads ``visible`` when it runs)
                if not torch.compiler.is_compiling():
                    kw["visible_host"] = [(p + 1) // kp for p in range(S, S + T)]
                    if not use_triton:
                        kw["prune"] = reads_free(x.device)
                memo = self.selection_memo
                pools = None if memo is None else memo.get((S, T))
                if pools is None:  # a chunk seen before (the chunked step's grad pass) reuses its selection
                    pools = topk_fn(iq, iw, pool_k, n_vis_pools, K, self.tile_tokens, index_dtype=torch.int32, **kw)
                    ran_triton = use_triton
                    if memo is not None:
                        memo[(S, T)] = pools
            else:
                pools = torch.full((B, T, 0), SENTINEL, dtype=torch.int32, device=x.device)
            sel = DSASelection(pools, pos, kp, self.tail)
        elif self.indexer is None and self.mode == "sparse":
            if selection is None:
                raise ValueError("a shared DSA layer needs the selection of the full DSA layer right before it")
            if selection.pools.shape[:2] != (B, T):
                raise ValueError(f"shared DSA layer: selection of {tuple(selection.pools.shape[:2])} rows for {(B, T)}")
            sel = selection
        if self.mode == "sparse":
            o_lat = attn_fn(q_abs, latent, sel, self.scale, self.attn_tile_tokens)
            ran_triton = use_triton
            attended = (sel.pools >= 0).sum() * kp
            if sel.tail:
                attended = attended + B * ((sel.pos + 1) % kp).sum()
            attended = host_number(attended, int)  # a tensor while compiling: no host sync in the graph
            stats = {"path": "sparse", "keys_scored": scored, "keys_attended": attended}
        else:
            o_lat = self._dense(q_abs, latent, S)
            stats = {"path": "dense", "keys_scored": 0, "keys_attended": B * (T * S + T * (T + 1) // 2)}
        stats = {"path": stats["path"], "kernel": "triton" if ran_triton else "torch", **stats}
        stats["indexer"] = "shared" if self.indexer is None else "full"
        self.aux_loss = None
        stats["indexer_loss"] = None
        if self.indexer is not None and self.stage != "off" and torch.is_grad_enabled():
            loss = self._indexer_loss(q_abs.detach(), latent.detach(), sel, pos, iq, iw, pool_k)
            stats["indexer_loss"] = host_number(loss.detach(), float)
            self.aux_loss = loss * self.loss_coef
        self.stats = stats
        o = torch.einsum("bthr,hvr->bthv", o_lat.to(q_abs.dtype), W_UV)
        y = self.o_proj(o.reshape(B, T, H * self.v_head_dim))
        return y, new_cache, (sel if self.mode == "sparse" else None)

    def _dense(self, q: Tensor, kv: Tensor, S: int) -> Tensor:
        """Exact causal attention (``dsa_mode="dense"``) in the absorbed form with torch SDPA, in query tiles of
        ``rows x (S + rows_end) <= indexer_tile_tokens``: q ``[B, T, H, R]``, kv ``[B, N, R]`` -> ``[B, T, H, R]``."""
        B, T, H, R = q.shape
        N = kv.shape[1]
        qh = q.transpose(1, 2)
        kh = kv.unsqueeze(1).to(q.dtype)  # [B, 1, N, R]: one latent shared by all heads
        rows = max(1, self.tile_tokens // N)
        if S == 0 and rows >= T:
            o = F.scaled_dot_product_attention(qh, kh, kh, is_causal=True, scale=self.scale, enable_gqa=H > 1)
            return o.transpose(1, 2)
        outs = []
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            n = S + r1
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(S + r0, n, device=q.device)[:, None]
            outs.append(
                F.scaled_dot_product_attention(
                    qh[:, :, r0:r1], kh[:, :, :n], kh[:, :, :n], attn_mask=mask, scale=self.scale, enable_gqa=H > 1
                )
            )
        return torch.cat(outs, dim=2).transpose(1, 2)

    def _indexer_loss(self, q, kv, sel, pos, iq, iw, pool_k) -> Tensor:
        """Mean over the chunk's ``B x T`` queries of the pooled indexer KL (module docstring), per query tile
        with bounded memory. Stage "sparse": ``_IndexerKLSparse`` over the selection. Stage "warmup": dense
        attention tiles (recomputed in backward by ``torch.utils.checkpoint``) holding ``H x rows x (S + rows_end)``
        probabilities: practical for the short warm-up stage, not for 1M tokens."""
        B, T = q.shape[:2]
        if self.stage == "sparse":
            args = (sel.pools, sel.pos, sel.kpool, sel.tail, self.scale, self.attn_tile_tokens, DENSE_RATIO)
            total = _IndexerKLSparse.apply(iq, iw, pool_k, q, kv, *args)
        else:
            N = kv.shape[1]
            rows = max(1, self.tile_tokens // (N * self.n_heads))
            total = None
            for r0 in range(0, T, rows):
                r1 = min(T, r0 + rows)
                part = checkpoint(
                    _kl_warmup_tile,
                    q[:, r0:r1], kv, pos[r0:r1], iq[:, r0:r1], iw[:, r0:r1], pool_k, self.kpool, self.scale,
                    N - T + r1, use_reentrant=False,
                )  # fmt: skip
                total = part if total is None else total + part
        return total / (B * T)


@torch.library.custom_op("genoctx::indexer_topk_torch", mutates_args=())
def indexer_topk_op(
    index_q: Tensor,
    index_w: Tensor,
    index_k: Tensor,
    visible: Tensor,
    topk: int,
    tile_tokens: int,
    index_dtype: torch.dtype = torch.long,
    prune: bool = True,
) -> Tensor:
    """``indexer_topk`` as one ``torch.library`` op (``genoctx::indexer_topk_torch``; the Triton kernel's op is
    ``genoctx::indexer_topk``), so that ``torch.compile`` calls it
    without tracing its host-driven tiles (reading ``visible``, pruning thresholds, ragged candidates): the compiled
    DSA layer has no graph break there. Same arguments and result; no gradient (integer output)."""
    return indexer_topk(index_q, index_w, index_k, visible, topk, tile_tokens, index_dtype, prune)


@indexer_topk_op.register_fake
def _indexer_topk_fake(index_q, index_w, index_k, visible, topk, tile_tokens, index_dtype=torch.long, prune=True):
    B, T = index_q.shape[:2]
    return index_q.new_empty(B, T, torch.sym_min(topk, index_k.shape[1]), dtype=index_dtype)
