"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer picks top-k keys per query, and
attention runs over those keys only.

Design choices:

- Positional encoding: none (NoPE), as the global-attention layers of Kimi Linear: order comes from the
  KDA layers of the hybrid. Neither the attention nor the indexer uses RoPE.
- Attention is multi-query by default (``dsa_kv_heads = 1``: one shared key/value head, the MQA form in which
  DeepSeek-V3.2 runs MLA); grouped-query for ``dsa_kv_heads > 1``. The top-k set is chosen per token and
  shared by all heads.
- Lightning indexer: ``I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])`` with one shared index key per
  token and ``w = proj(h) * H_I^-1/2 * d_I^-1/2`` (the ``d_I^-1/2`` softmax scale as in DeepSeek-V3.2's
  reference inference code). Scores are computed per query tile (rows x key columns within
  ``indexer_tile_tokens``) and reduced to top-k per tile at once: no ``[T, S+T]`` score tensor ever exists
  (``indexer_topk``). Each row keeps its k-th best score as a threshold, and key groups whose maximum is
  below it skip the top-k merge: the cost per (query, key) pair is one fused matrix product over the index
  heads plus a few elementwise passes (about 1 ns on a 2-core CPU, ``bench/eval_long.py``).
- Sentinel: a query at absolute position ``p`` sees ``p + 1`` keys; when that is fewer than the top-k, the
  unused slots of its index row hold ``-1``. Every consumer masks ``-1`` (zero weight forward, no gradient,
  and nothing is scattered into any row for it).
- Sparse attention is one autograd Function (``sparse_attention``) that works in query tiles, gathers the
  selected keys/values per tile, saves only ``q, k, v, idx`` and the per-row logsumexp, and regathers in
  backward: memory O(T x top-k), never O(T^2).
- The indexer is trained by a KL loss (DeepSeek-V3.2) exposed as ``aux_loss`` (already multiplied by
  ``indexer_loss_coef``; the model adds it to the LM loss). The indexer reads ``x.detach()``, and top-k is not
  differentiable, so the indexer learns only from the KL and the rest of the model only from the LM loss.
- Dense attention runs only when ``dsa_mode == "dense"`` is asked for. A configuration that cannot run sparse
  raises ``ValueError``. The path that ran is recorded in ``stats["path"]``.
- Chunk contract: ``forward(x, cache)`` takes the keys/values/index keys of all earlier positions
  (``DSACache``) and returns them extended by this chunk's (not detached: gradients reach earlier chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig

SENTINEL = -1  # index-row slot with no key (query has fewer visible keys than top-k)
# Indexer scores tie often (ReLU makes many exactly 0). torch.topk breaks ties in an unspecified order, which
# would make the selected set depend on how keys are tiled or chunked. Adding position * TIE_BREAK before the
# top-k makes the selection a fixed function of (query, key): among equal scores the most recent keys win.
TIE_BREAK = 2.0**-40
ATTN_TILE_TOKENS = 1 << 16  # sparse attention: query-tile rows x selected keys held at once
INDEX_ROW_TILE = 256  # indexer_topk: query rows per tile (fast path; bounded by indexer_tile_tokens)
INDEX_COL_BLOCK = 4096  # indexer_topk: key columns per block (a multiple of INDEX_GROUP)
INDEX_GROUP = 32  # indexer_topk: key columns per pruning group (block maxima are compared to the threshold)


@dataclass
class DSACache:
    """Keys of all ``S`` earlier positions (``S`` may be 0), as the next chunk needs them.

    Attributes:
        k: attention keys ``[B, S, KVH, Dh]``.
        v: attention values ``[B, S, KVH, Dh]``.
        index_k: indexer keys ``[B, S, d_I]``.
    """

    k: Tensor
    v: Tensor
    index_k: Tensor

    @property
    def length(self) -> int:
        """Number of cached positions ``S``."""
        return self.k.shape[1]


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
            s = torch.relu(torch.bmm(qi[:, :, j], kt)) * wi[:, :, j, None]
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


def indexer_topk(
    index_q: Tensor,
    index_w: Tensor,
    index_k: Tensor,
    q_offset: int,
    topk: int,
    tile_tokens: int,
    index_dtype: torch.dtype = torch.long,
    prune: bool = True,
) -> Tensor:
    """Top-k keys per query by the lightning indexer (DeepSeek-V3.2), in query tiles, causal.

    ``I[t, s] = sum_j index_w[t, j] * ReLU(index_q[t, j] . index_k[s])`` for ``s <= q_offset + t``, plus
    ``s * TIE_BREAK`` (among equal scores the most recent key wins, whatever the tiling).

    Args:
        index_q: ``[B, T, H_I, d_I]`` indexer queries (any float dtype; scored in at least fp32).
        index_w: ``[B, T, H_I]`` per-head weights (already scaled).
        index_k: ``[B, S + T, d_I]`` indexer keys of all positions (cache first).
        q_offset: absolute position of query row 0 (normally ``S``); query row ``t`` sees keys
            ``0 .. q_offset + t``.
        topk: keys kept per query (>= 1).
        tile_tokens: score budget: query rows x key columns of one tile (per batch row), at least one row by
            ``INDEX_GROUP`` columns. The tile is at most ``INDEX_ROW_TILE x INDEX_COL_BLOCK`` (sized to stay in
            a CPU core's cache); rows longer than a block are merged by a running top-k.
        index_dtype: dtype of the returned indices: int64 (default) or int32 (half the memory: at 1M tokens
            and top-2048 the index is 16 GiB in int64; ``DeepSeekSparseAttention`` uses int32).
        prune: skip key groups that cannot enter a row's top-k. Each row keeps its current k-th best score as
            a threshold; a block's columns are grouped by ``INDEX_GROUP`` and only groups whose maximum
            exceeds the threshold are merged (the full top-k over a block costs ~4x the scores; most groups
            of a long row fall below the threshold). Blocks are visited from the most recent keys backwards,
            so the threshold rises early. The result equals ``prune=False`` (the plain running top-k),
            tested, except where two keys have exactly equal scores at the k-th place (fp32 scores above
            ~1 round ``TIE_BREAK`` away), where either may be kept.

    Returns:
        ``idx`` (``index_dtype``) ``[B, T, min(topk, S + T)]``: selected key positions in descending score order;
        slots beyond a query's visible keys hold ``SENTINEL`` (-1).

    Raises:
        ValueError: ``topk < 1``, ``tile_tokens < 1``, or ``q_offset + T > S + T`` keys.

    Runs under ``torch.no_grad``. No ``[T, S + T]`` tensor is materialised: each tile is reduced to top-k
    immediately. Cost: ``2 H_I d_I`` FLOPs per visible (query, key) pair, quadratic in position as in
    DeepSeek-V3.2; ``bench/eval_long.py`` measures it at 1M tokens.
    """
    if topk < 1 or tile_tokens < 1:
        raise ValueError(f"indexer_topk needs topk >= 1 and tile_tokens >= 1, got {topk}, {tile_tokens}")
    B, T, H_I, d_I = index_q.shape
    N = index_k.shape[1]
    if q_offset < 0 or q_offset + T > N:
        raise ValueError(f"indexer_topk: queries at {q_offset}..{q_offset + T - 1} but only {N} keys")
    if index_dtype not in (torch.long, torch.int32) or (index_dtype == torch.int32 and N >= 2**31):
        raise ValueError(f"indexer_topk: index_dtype must be int64 or int32 (N < 2^31), got {index_dtype}")
    K = min(topk, N)
    dt = _acc_dtype(index_q.dtype)
    dev = index_q.device
    g = INDEX_GROUP
    n_keys = q_offset + T  # keys any query of the call may see
    # column block: a multiple of the group, within the budget; row tile: the rest of the budget
    C = max(g, min(INDEX_COL_BLOCK, tile_tokens) // g * g)
    C = min(C, -(-n_keys // g) * g)
    R = max(1, min(INDEX_ROW_TILE, T, tile_tokens // C))
    out = torch.empty(B, T, K, dtype=index_dtype, device=dev)
    buf = torch.empty(R * H_I * C, dtype=dt, device=dev)
    sbuf = torch.empty(R * C, dtype=dt, device=dev)
    cols_all = torch.arange(n_keys + C, device=dev)
    tie_all = cols_all.to(dt) * TIE_BREAK
    with torch.no_grad():
        for b in range(B):
            kt = index_k[b, :n_keys].to(dt).t().contiguous()  # [d_I, n_keys]
            for r0 in range(0, T, R):
                r1 = min(T, r0 + R)
                Rt = r1 - r0
                q2 = index_q[b, r0:r1].to(dt).reshape(Rt * H_I, d_I)
                w3 = index_w[b, r0:r1].to(dt).reshape(Rt, 1, H_I)
                pos = torch.arange(q_offset + r0, q_offset + r1, device=dev)  # [Rt] absolute query positions
                n_vis = q_offset + r1  # keys visible to the tile's last row
                best_v = torch.full((Rt, K), float("-inf"), dtype=dt, device=dev)
                best_i = torch.full((Rt, K), SENTINEL, dtype=torch.long, device=dev)
                pend_v, pend_i = [], []  # pruned candidates [Rt, w] waiting for one merged top-k
                starts = list(range(0, n_vis, C))
                for c0 in reversed(starts) if prune else starts:
                    c1 = min(n_vis, c0 + C)
                    s = _index_scores_tile(q2, w3, kt[:, c0:c1], buf, sbuf)  # [Rt, c1 - c0], no tie-break yet
                    if c1 - 1 > q_offset + r0:  # the block reaches past some row's position: causal mask
                        s.masked_fill_(cols_all[c0:c1][None, :] > pos[:, None], float("-inf"))
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
                # descending score; equal scores (fp32 ties the tie-break cannot split) most recent key first
                best_i, j = best_i.sort(dim=-1, descending=True)
                best_v = best_v.gather(-1, j)
                best_v, j = best_v.sort(dim=-1, descending=True, stable=True)
                best_i = best_i.gather(-1, j)
                out[b, r0:r1] = best_i.masked_fill(torch.isneginf(best_v), SENTINEL).to(index_dtype)
    return out


def _no_autocast(fn):
    """Run an autograd Function's forward/backward with autocast off: they pick their own (>= fp32) dtypes."""

    def wrapped(ctx, *args):
        dev = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        with torch.autocast(device_type=dev, enabled=False):
            return fn(ctx, *args)

    return wrapped


def _gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, N, ...]`` gathered at ``idx [B, R, K]`` (entries >= 0) -> ``[B, R, K, ...]``."""
    B, N = x.shape[:2]
    flat = x.reshape(B * N, -1)
    off = (torch.arange(B, device=x.device) * N).view(B, 1, 1)
    g = flat.index_select(0, (idx + off).reshape(-1))
    return g.view(*idx.shape, *x.shape[2:])


def _scatter_rows_(acc: Tensor, idx: Tensor, src: Tensor) -> None:
    """``acc [B, N, ...] += src [B, R, K, ...]`` at ``idx [B, R, K]`` (entries >= 0)."""
    B, N = acc.shape[:2]
    off = (torch.arange(B, device=acc.device) * N).view(B, 1, 1)
    acc.view(B * N, -1).index_add_(0, (idx + off).reshape(-1), src.reshape(idx.numel(), -1))


class _SparseAttention(torch.autograd.Function):
    """Softmax attention of each query over its selected keys; query tiles; gathers recomputed in backward."""

    @staticmethod
    @_no_autocast
    def forward(ctx, q, k, v, idx, scale, tile_tokens):
        B, T, H, Dh = q.shape
        KVH = k.shape[2]
        G = H // KVH
        Ksel = idx.shape[-1]
        dt = _acc_dtype(q.dtype)
        rows = max(1, tile_tokens // max(1, Ksel))
        o = torch.empty_like(q)
        lse = torch.empty(B, T, KVH, G, dtype=dt, device=q.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            it = idx[:, r0:r1]
            valid = it >= 0  # [B, R, K]
            ic = it.clamp_min(0)
            qt = q[:, r0:r1].to(dt).view(B, r1 - r0, KVH, G, Dh)
            ks = _gather_rows(k, ic).to(dt)  # [B, R, K, KVH, Dh]
            s = torch.einsum("brhgd,brkhd->brhgk", qt, ks).mul_(scale)
            del ks  # one gathered [R, K] block alive at a time
            s.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
            m = torch.logsumexp(s, dim=-1)  # [B, R, KVH, G]
            p = s.sub_(m[..., None]).exp_()
            ot = torch.einsum("brhgk,brkhd->brhgd", p, _gather_rows(v, ic).to(dt))
            o[:, r0:r1] = ot.reshape(B, r1 - r0, H, Dh).to(q.dtype)
            lse[:, r0:r1] = m
        ctx.save_for_backward(q, k, v, idx, lse)
        ctx.scale = scale
        ctx.rows = rows
        return o

    @staticmethod
    @_no_autocast
    def backward(ctx, do):
        q, k, v, idx, lse = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        B, T, H, Dh = q.shape
        KVH = k.shape[2]
        G = H // KVH
        dt = _acc_dtype(q.dtype)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=dt, device=k.device)
        dv = torch.zeros(v.shape, dtype=dt, device=v.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            R = r1 - r0
            it = idx[:, r0:r1]
            valid = it >= 0
            ic = it.clamp_min(0)
            qt = q[:, r0:r1].to(dt).view(B, R, KVH, G, Dh)
            dot = do[:, r0:r1].to(dt).view(B, R, KVH, G, Dh)
            # Sentinel slots hold exact zeros (p = 0 there); they are zeroed explicitly again before the
            # scatter and go to row 0, so no index -1 is ever scattered and no host sync is needed.
            inval = ~valid[..., None, None]
            # At most two gathered/gradient [R, K, KVH, Dh] blocks are alive at a time.
            vs = _gather_rows(v, ic).to(dt)
            dp = torch.einsum("brhgd,brkhd->brhgk", dot, vs)
            del vs
            ks = _gather_rows(k, ic).to(dt)
            p = torch.einsum("brhgd,brkhd->brhgk", qt, ks).mul_(scale).sub_(lse[:, r0:r1, ..., None]).exp_()
            p.masked_fill_(~valid[:, :, None, None, :], 0.0)
            dvs = torch.einsum("brhgk,brhgd->brkhd", p, dot)
            _scatter_rows_(dv, ic, dvs.masked_fill_(inval, 0.0))
            del dvs
            delta = (p * dp).sum(-1, keepdim=True)
            ds = dp.sub_(delta).mul_(p).mul_(scale)  # [B, R, KVH, G, K]
            del p
            dq[:, r0:r1] = torch.einsum("brhgk,brkhd->brhgd", ds, ks).reshape(B, R, H, Dh).to(q.dtype)
            del ks
            dks = torch.einsum("brhgk,brhgd->brkhd", ds, qt)  # [B, R, K, KVH, Dh]
            _scatter_rows_(dk, ic, dks.masked_fill_(inval, 0.0))
            del dks
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, scale: float, tile_tokens: int = ATTN_TILE_TOKENS
) -> Tensor:
    """Attention of each query over its selected keys only (DeepSeek-V3.2 sparse attention, MQA/GQA).

    ``o[t, h] = sum_{s in idx[t]} softmax_s(scale * q[t, h] . k[s, h // G]) v[s, h // G]``, ``G = H / KVH``.

    Args:
        q: ``[B, T, H, Dh]`` queries.
        k: ``[B, N, KVH, Dh]`` keys of all positions (``N = S + T``: cache first).
        v: ``[B, N, KVH, Dh]`` values.
        idx: int64 or int32 ``[B, T, K]`` selected key positions; ``SENTINEL`` (-1) slots are ignored (every row needs
            at least one valid entry).
        scale: logit scale, e.g. ``Dh ** -0.5``.
        tile_tokens: query-tile rows x ``K`` handled at once (memory knob).

    Returns:
        ``o [B, T, H, Dh]`` in ``q``'s dtype (computed in at least fp32).

    Differentiable w.r.t. ``q``, ``k``, ``v`` (including cached keys/values). Saves ``q, k, v, idx`` and the
    per-row logsumexp; gathered keys/values are recomputed per tile in backward and gradients are
    accumulated with ``index_add_`` skipping sentinels. Memory O(T x K), never O(T^2).

    Raises:
        ValueError: shapes that do not fit (``H`` not a multiple of ``KVH``, ``idx`` rows != ``T``).
    """
    B, T, H, _ = q.shape
    if H % k.shape[2] or idx.shape[:2] != (B, T) or k.shape != v.shape:
        raise ValueError(
            f"sparse_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"idx {tuple(idx.shape)}"
        )
    return _SparseAttention.apply(q, k, v, idx, float(scale), int(tile_tokens))


def _kl_rows(p: Tensor, logits: Tensor, valid: Tensor) -> Tensor:
    """Sum over rows of ``KL(p || softmax(logits))`` restricted to ``valid``; ``p`` is 0 where invalid."""
    logq = torch.log_softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    logq = logq.masked_fill(~valid, 0.0)
    return (torch.xlogy(p, p) - p * logq).sum()


class _IndexerKLSparse(torch.autograd.Function):
    """Indexer KL of the sparse stage, summed over queries, with its gradients computed in the same pass.

    Per query tile: target ``p`` = L1-normalised head-sum of the main attention on the selected keys (no grad);
    ``l = sum_j w_j ReLU(q_I_j . k_I)`` on the selected keys; ``KL(p || softmax(l))``, whose gradient w.r.t.
    ``l`` is ``softmax(l) - p``; this is pushed through the ReLU scores to ``index_q``, ``index_w`` and
    ``index_k`` (scattered with ``index_add_``) at once. Backward only scales the stored gradients (all O(T)),
    so nothing of size T x top-k is kept or recomputed.
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, iq, iw, ik, q, k, idx, scale, rows):
        B, T, H, Dh = q.shape
        KVH = k.shape[2]
        dt = _acc_dtype(iq.dtype)
        diq = torch.zeros(iq.shape, dtype=dt, device=iq.device)
        diw = torch.zeros(iw.shape, dtype=dt, device=iw.device)
        dik = torch.zeros(ik.shape, dtype=dt, device=ik.device)
        total = torch.zeros((), dtype=dt, device=iq.device)
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            R = r1 - r0
            it = idx[:, r0:r1]
            valid = it >= 0
            ic = it.clamp_min(0)
            ks = _gather_rows(k, ic).to(_acc_dtype(q.dtype))
            qt = q[:, r0:r1].to(ks.dtype).view(B, R, KVH, H // KVH, Dh)
            sa = torch.einsum("brhgd,brkhd->brhgk", qt, ks).mul_(scale)
            del ks
            sa.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
            pt = torch.softmax(sa, dim=-1).sum(dim=(2, 3))
            del sa
            pt = (pt / pt.sum(-1, keepdim=True)).to(dt)  # [B, R, K]
            iks = _gather_rows(ik, ic).to(dt)  # [B, R, K, d_I]
            qi, wi = iq[:, r0:r1].to(dt), iw[:, r0:r1].to(dt)
            a = torch.einsum("brjd,brkd->brjk", qi, iks)  # [B, R, H_I, K]
            rl = torch.relu(a)
            logits = (rl * wi[..., None]).sum(2).masked_fill_(~valid, float("-inf"))
            logq = torch.log_softmax(logits, dim=-1).masked_fill_(~valid, 0.0)
            total += (torch.xlogy(pt, pt) - pt * logq).sum()
            g = (logq.exp_() - pt).masked_fill_(~valid, 0.0)  # dKL/dlogits
            diw[:, r0:r1] = torch.einsum("brk,brjk->brj", g, rl)
            da = (a > 0).to(dt).mul_(g[:, :, None, :]).mul_(wi[..., None])  # [B, R, H_I, K]
            diq[:, r0:r1] = torch.einsum("brjk,brkd->brjd", da, iks)
            _scatter_rows_(dik, ic, torch.einsum("brjk,brjd->brkd", da, qi))  # sentinel rows carry zeros
        ctx.save_for_backward(diq, diw, dik)
        ctx.dtypes = (iq.dtype, iw.dtype, ik.dtype)
        return total

    @staticmethod
    def backward(ctx, gout):
        diq, diw, dik = ctx.saved_tensors
        tq, tw, tk = ctx.dtypes
        return (gout * diq).to(tq), (gout * diw).to(tw), (gout * dik).to(tk), None, None, None, None, None


def _kl_warmup_tile(qt, kall, q_pos0, iq, iw, ik, scale):
    """KL of one query tile, warm-up stage: target = head-summed dense attention over all visible keys."""
    B, R, H, Dh = qt.shape
    KVH = kall.shape[2]
    n = q_pos0 + R
    pos = torch.arange(q_pos0, n, device=qt.device)
    valid = (torch.arange(n, device=qt.device)[None, :] <= pos[:, None])[None].expand(B, R, n)
    dt = _acc_dtype(iq.dtype)
    with torch.no_grad():
        kd = kall[:, :n].to(_acc_dtype(qt.dtype))
        s = torch.einsum("brhgd,bkhd->brhgk", qt.to(kd.dtype).view(B, R, KVH, H // KVH, Dh), kd) * scale
        s.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).sum(dim=(2, 3))
        p = (p / p.sum(-1, keepdim=True)).to(dt)
    logits = _index_scores_block(iq.to(dt), iw.to(dt), ik[:, :n].to(dt))
    return _kl_rows(p, logits, valid)


class DeepSeekSparseAttention(nn.Module):
    """DSA mixing layer: q/k/v/o projections (MQA/GQA, NoPE) plus the lightning indexer.

    Config fields read: ``d_model, dsa_heads, dsa_kv_heads, dsa_head_dim, index_heads, index_head_dim,
    index_topk, indexer_tile_tokens, dsa_mode, indexer_stage, indexer_loss_coef, init_std``.

    After each ``forward``: ``self.stats = {"path", "keys_scored", "keys_attended", "indexer_loss"}`` and
    ``self.aux_loss`` (indexer KL x ``indexer_loss_coef``, a scalar tensor; ``None`` for stage "off" or when
    grad is disabled).

    Raises:
        ValueError: a configuration that cannot run (``index_topk < 1`` in sparse mode, non-positive widths or
            tile budget, unknown mode or stage).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.dsa_heads, cfg.dsa_kv_heads, cfg.dsa_head_dim
        self.index_heads, self.index_head_dim = cfg.index_heads, cfg.index_head_dim
        self.topk, self.tile_tokens = cfg.index_topk, cfg.indexer_tile_tokens
        self.mode, self.stage, self.loss_coef = cfg.dsa_mode, cfg.indexer_stage, cfg.indexer_loss_coef
        self.attn_tile_tokens = getattr(cfg, "attn_tile_tokens", ATTN_TILE_TOKENS)
        if self.mode not in ("sparse", "dense"):
            raise ValueError(f"dsa_mode must be 'sparse' or 'dense', got {self.mode!r}")
        if self.stage not in ("sparse", "warmup", "off"):
            raise ValueError(f"indexer_stage must be 'sparse', 'warmup' or 'off', got {self.stage!r}")
        if min(self.n_heads, self.n_kv_heads, self.head_dim, self.index_heads, self.index_head_dim) < 1:
            raise ValueError("DSA widths (heads, head dims, index heads/dims) must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"dsa_heads {self.n_heads} is not a multiple of dsa_kv_heads {self.n_kv_heads}")
        if self.mode == "sparse" and self.topk < 1:
            raise ValueError(
                f"DSA cannot run sparse with index_topk={self.topk} (needs >= 1); "
                "set dsa_mode='dense' to ask for dense attention"
            )
        if self.tile_tokens < 1 or self.attn_tile_tokens < 1:
            raise ValueError(f"indexer_tile_tokens must be >= 1, got {self.tile_tokens}")
        D, H, KVH, Dh = cfg.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, KVH * Dh, bias=False)
        self.v_proj = nn.Linear(D, KVH * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        self.index_q_proj = nn.Linear(D, self.index_heads * self.index_head_dim, bias=False)
        self.index_k_proj = nn.Linear(D, self.index_head_dim, bias=False)
        self.index_w_proj = nn.Linear(D, self.index_heads, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.init_std)
        self.stats: dict = {}
        self.aux_loss: Tensor | None = None

    def indexer_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Indexer queries ``[B,T,H_I,d_I]``, weights ``[B,T,H_I]``, keys ``[B,T,d_I]`` of ``x.detach()``."""
        h = x.detach()
        B, T, _ = h.shape
        iq = self.index_q_proj(h).view(B, T, self.index_heads, self.index_head_dim)
        iw = self.index_w_proj(h) * (self.index_heads**-0.5 * self.index_head_dim**-0.5)
        return iq, iw, self.index_k_proj(h)

    def forward(self, x: Tensor, cache: DSACache | None = None) -> tuple[Tensor, DSACache]:
        """One chunk: ``x [B, T, D]`` and the cache of the ``S`` earlier positions -> ``([B, T, D], cache)``.

        The returned cache holds ``S + T`` positions and is not detached.
        """
        B, T, _ = x.shape
        H, KVH, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, Dh)
        k = self.k_proj(x).view(B, T, KVH, Dh)
        v = self.v_proj(x).view(B, T, KVH, Dh)
        iq, iw, ik = self.indexer_inputs(x)
        if cache is not None and cache.length > 0:
            S = cache.length
            k_all, v_all = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
            ik_all = torch.cat([cache.index_k, ik], 1)
        else:
            S, k_all, v_all, ik_all = 0, k, v, ik
        scale = Dh**-0.5
        visible = B * (T * S + T * (T + 1) // 2)  # causal query-key pairs of the chunk
        if self.mode == "sparse":
            idx = indexer_topk(iq, iw, ik_all, S, self.topk, self.tile_tokens, index_dtype=torch.int32)
            o = sparse_attention(q, k_all, v_all, idx, scale, self.attn_tile_tokens)
            n_vis = torch.arange(S + 1, S + T + 1).clamp_(max=idx.shape[-1])  # keys each query attends
            stats = {"path": "sparse", "keys_scored": visible, "keys_attended": B * int(n_vis.sum())}
        else:
            idx = None
            o = self._dense(q, k_all, v_all, S, scale)
            stats = {"path": "dense", "keys_scored": 0, "keys_attended": visible}
        self.aux_loss = None
        stats["indexer_loss"] = None
        if self.stage != "off" and torch.is_grad_enabled():
            loss = self._indexer_loss(q.detach(), k_all.detach(), idx, S, iq, iw, ik_all, scale)
            stats["indexer_loss"] = float(loss.detach())
            self.aux_loss = loss * self.loss_coef
        self.stats = stats
        y = self.o_proj(o.reshape(B, T, H * Dh))
        return y, DSACache(k_all, v_all, ik_all)

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, S: int, scale: float) -> Tensor:
        """Exact causal attention (``dsa_mode="dense"``) with torch SDPA in query tiles of
        ``rows x (S + rows_end) <= indexer_tile_tokens``; the one-tile, no-cache case uses ``is_causal``."""
        B, T, H, Dh = q.shape
        N = k.shape[1]
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = self.n_kv_heads != H
        rows = max(1, self.tile_tokens // N)
        if S == 0 and rows >= T:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
            return o.transpose(1, 2)
        outs = []
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            n = S + r1
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(S + r0, n, device=q.device)[:, None]
            outs.append(
                F.scaled_dot_product_attention(
                    qh[:, :, r0:r1], kh[:, :, :n], vh[:, :, :n], attn_mask=mask, scale=scale, enable_gqa=gqa
                )
            )
        return torch.cat(outs, dim=2).transpose(1, 2)

    def _indexer_loss(self, q, k_all, idx, S, iq, iw, ik_all, scale) -> Tensor:
        """Mean over the chunk's ``B x T`` queries of the indexer KL (DeepSeek-V3.2), per query tile with
        bounded memory: only one tile's gathered keys live at a time.

        Stage "sparse": target = L1-normalised head-sum of the main attention on the selected keys (detached),
        model = softmax of the indexer scores restricted to the same keys. With ``dsa_mode="dense"`` the
        selection is computed here (``indexer_topk``) only for this loss.
        Computed by ``_IndexerKLSparse`` (loss and gradients in one pass).
        Stage "warmup": target = the dense attention over all visible keys (tiles recomputed in backward by
        ``torch.utils.checkpoint``); the indexer softmax runs over all visible keys too. Tiles hold
        ``H x rows x (S + rows_end)`` probabilities: practical for short sequences (the warm-up stage of
        DeepSeek-V3.2 is short), not for 1M tokens.
        """
        B, T = q.shape[:2]
        total = None
        if self.stage == "sparse":
            if idx is None:
                idx = indexer_topk(iq, iw, ik_all, S, max(1, self.topk), self.tile_tokens, index_dtype=torch.int32)
            rows = max(1, self.attn_tile_tokens // idx.shape[-1])
            total = _IndexerKLSparse.apply(iq, iw, ik_all, q, k_all, idx, scale, rows)
        else:
            N = k_all.shape[1]
            rows = max(1, self.tile_tokens // (N * self.n_heads))
            for r0 in range(0, T, rows):
                r1 = min(T, r0 + rows)
                part = checkpoint(
                    _kl_warmup_tile,
                    q[:, r0:r1],
                    k_all,
                    S + r0,
                    iq[:, r0:r1],
                    iw[:, r0:r1],
                    ik_all,
                    scale,
                    use_reentrant=False,
                )
                total = part if total is None else total + part
        return total / (B * T)
