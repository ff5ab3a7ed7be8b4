"""Slow, obviously-correct reference implementations used by the tests.

Nothing here is used on a training path. Each function says which fast path it checks.
"""

from __future__ import annotations

import torch  # noqa: F401

# ---- KDA references (owned by the KDA work; edit only inside this section) ----


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention, one token at a time (checks ``genoctx.model.kda.chunk_kda``).

    Kimi Linear (Moonshot AI, 2025), eq. for the gated delta rule with per-channel decay. For each token t:

        S <- Diag(exp g_t) S                      (row-wise decay of the [K, V] state)
        S <- S + beta_t k_t (v_t - S^T k_t)^T     (delta rule)
        o_t = S^T (q_t * scale)

    i.e. ``S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (any float dtype).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log decay per key channel (<= 0).
        beta: ``[B, T, H]`` delta-rule write strength (in [0, 1] in the layer).
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` or None (zeros).

    Returns:
        ``(o, S)``: ``o`` ``[B, T, H, V]`` in ``v.dtype``; ``S`` ``[B, H, K, V]`` final state in fp32 (fp64
        when the inputs are fp64). Computed in fp32 (fp64 for fp64 inputs); differentiable by autograd.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.to(ct) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(ct)
    outs = []
    # unbind (not q[:, t]): autograd then stacks the per-token gradients once instead of writing a
    # full-size zero gradient per token, so the backward stays linear in T.
    for q_t, k_t, v_t, g_t, b_t in zip(*(x.unbind(1) for x in (q, k, v, g, beta)), strict=True):
        S = S * g_t.exp()[..., None]  # [B, H, K, V] row-wise decay
        err = v_t - torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + b_t[..., None, None] * k_t[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t * scale, S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), S


# ---- end KDA references ----


# ---- DSA references (owned by the DSA work; edit only inside this section) ----


def dense_causal_attention(q: torch.Tensor, kv: torch.Tensor, scale: float, q_offset: int = 0) -> torch.Tensor:
    """Plain causal softmax attention in MLA's absorbed form (checks ``dsa_mode="dense"`` and DSA with a
    selection covering every visible token).

    Args:
        q: ``[B, T, H, R]`` queries in the latent; kv: ``[B, N, R]`` latents (keys and values of every head).
        scale: logit scale.
        q_offset: absolute position of query row 0 (row ``t`` sees keys ``0 .. q_offset + t``).

    Returns:
        ``[B, T, H, R]``. Builds the full ``[B, H, T, N]`` matrix: tests only.
    """
    s = torch.einsum("bthd,bsd->bhts", q, kv) * scale
    T, N = q.shape[1], kv.shape[1]
    mask = torch.arange(N)[None, :] > (torch.arange(T) + q_offset)[:, None]
    s = s.masked_fill(mask.to(s.device), float("-inf"))
    return torch.einsum("bhts,bsd->bthd", torch.softmax(s, dim=-1), kv)


def pooled_indexer_scores_reference(
    index_q: torch.Tensor, index_w: torch.Tensor, pool_k: torch.Tensor, pos: torch.Tensor, kpool: int
) -> torch.Tensor:
    """Full KPool indexer score matrix, pools a query cannot see (last token after it) masked to ``-inf``.

    ``I[b, t, p] = sum_j index_w[b, t, j] * ReLU(index_q[b, t, j] . pool_k[b, p])`` for ``(p + 1) kpool <= pos_t + 1``.
    Shapes: ``[B,T,H_I,d_I]``, ``[B,T,H_I]``, ``[B,P,d_I]``, ``pos [T]`` -> ``[B, T, P]``.
    """
    s = (torch.relu(torch.einsum("btjd,bpd->btjp", index_q, pool_k)) * index_w[..., None]).sum(2)
    P = pool_k.shape[1]
    visible = torch.arange(P)[None, :] < ((pos.cpu() + 1) // kpool)[:, None]
    return s.masked_fill(~visible.to(s.device), float("-inf"))


def pool_keys_reference(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """Pool keys with explicit loops over pools and channels (checks ``Indexer.pool``): for pool ``p`` and channel
    ``c``, ``sum_i softmax_i(gate[p kpool + i, c] + ape[i, c]) k[p kpool + i, c]``.
    ``[B, n, d] -> [B, n // kpool, d]``."""
    B, n, d = k.shape
    P = n // kpool
    out = k.new_zeros(B, P, d)
    for p in range(P):
        sl = slice(p * kpool, (p + 1) * kpool)
        w = torch.softmax(gate[:, sl] + ape[None], dim=1)
        out[:, p] = (w * k[:, sl]).sum(1)
    return out


def selection_reference(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    pool_k: torch.Tensor,
    pos: torch.Tensor,
    kpool: int,
    topk: int,
    tail: bool,
) -> torch.Tensor:
    """Tokens each query attends, the obvious way: full pool score matrix, top ``topk // kpool`` visible pools
    (ties toward the most recent pool, as ``dsa.indexer_topk``), expanded to tokens, plus the visible tokens of
    the query's incomplete pool when ``tail``. Returns a ``[B, T, N]`` bool mask over ``N = pos[-1] + 1`` keys."""
    from .dsa import TIE_BREAK

    B, T = index_q.shape[:2]
    N = int(pos[-1]) + 1
    keep = torch.zeros(B, T, N, dtype=torch.bool)
    P = pool_k.shape[1]
    if P > 0:
        scores = pooled_indexer_scores_reference(index_q, index_w, pool_k, pos, kpool)
        scores = scores + torch.arange(P, dtype=scores.dtype, device=scores.device) * TIE_BREAK
        val, idx = scores.topk(min(topk // kpool, P), dim=-1)
        for b in range(B):
            for t in range(T):
                for v, p in zip(val[b, t].tolist(), idx[b, t].tolist(), strict=True):
                    if v != float("-inf"):
                        keep[b, t, p * kpool : (p + 1) * kpool] = True
    if tail:
        for t in range(T):
            p = int(pos[t])
            keep[:, t, (p + 1) // kpool * kpool : p + 1] = True
    return keep


def masked_mla_attention(q: torch.Tensor, kv: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked dense softmax of ``q [B, T, H, R]`` over latents ``kv [B, N, R]`` where ``keep [B, T, N]``; a row with
    nothing kept gives 0 (SDPA's convention, as the reference). Checks ``dsa.sparse_mla``: builds ``[B, H, T, N]``."""
    s = torch.einsum("bthd,bsd->bhts", q, kv) * scale
    s = s.masked_fill(~keep[:, None].to(s.device), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1))
    return torch.einsum("bhts,bsd->bthd", p, kv)


def dsa_layer_reference(layer, x: torch.Tensor, selection_keep: torch.Tensor | None = None):
    """A ``DeepSeekSparseAttention`` layer computed the obvious way: expanded (non-absorbed) MLA with per-head keys
    ``W_UK c`` and values ``W_UV c``, the full indexer matrix, an ``L x L`` mask, no tiles, no cache.

    Args:
        layer: a ``dsa.DeepSeekSparseAttention`` (its parameters are used; differentiable w.r.t. them and ``x``).
        x: ``[B, T, D]``.
        selection_keep: for a "shared" layer, the ``[B, T, T]`` mask of the full layer before it.

    Returns:
        ``(y [B, T, D], keep [B, T, T])`` (keep: what each query attends; in dense mode every causal key).
    """
    B, T, _ = x.shape
    H, dq, dv = layer.n_heads, layer.qk_head_dim, layer.v_head_dim
    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(B, T, H, dq)
    c = layer.latent(x)
    kvh = layer.kv_b_proj(c).view(B, T, H, dq + dv)
    k, v = kvh[..., :dq], kvh[..., dq:]
    pos = torch.arange(T)
    if layer.mode == "dense":
        keep = (torch.arange(T)[None, :] <= pos[:, None]).expand(B, T, T)
    elif layer.indexer is None:
        keep = selection_keep
    else:
        ind = layer.indexer
        with torch.no_grad():
            ik, ig = ind.keys(x)
            n = T // ind.kpool * ind.kpool
            pool_k = pool_keys_reference(ik[:, :n], ig[:, :n], ind.index_kpool_compress_ape, ind.kpool)
            iq, iw = ind.queries(x, layer.q_a_layernorm(layer.q_a_proj(x)))
            keep = selection_reference(iq, iw, pool_k, pos, ind.kpool, layer.topk, layer.tail)
    s = torch.einsum("bthd,bshd->bhts", q, k) * layer.scale
    s = s.masked_fill(~keep[:, None].to(s.device), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1))
    o = torch.einsum("bhts,bshd->bthd", p, v)
    return layer.o_proj(o.reshape(B, T, H * dv)), keep


# ---- end DSA references ----
