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


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0
) -> torch.Tensor:
    """Plain causal softmax attention (checks DSA with top-k >= length, and ``dsa_mode="dense"``).

    Args:
        q: ``[B, T, H, Dh]``; k, v: ``[B, N, KVH, Dh]`` (MQA/GQA: head ``h`` uses kv head ``h // (H / KVH)``).
        scale: logit scale.
        q_offset: absolute position of query row 0 (row ``t`` sees keys ``0 .. q_offset + t``).

    Returns:
        ``[B, T, H, Dh]``. Builds the full ``[B, H, T, N]`` matrix: tests only.
    """
    H, KVH = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(H // KVH, dim=2)
    vv = v.repeat_interleave(H // KVH, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    T, N = q.shape[1], k.shape[1]
    mask = torch.arange(N)[None, :] > (torch.arange(T) + q_offset)[:, None]
    s = s.masked_fill(mask.to(s.device), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), vv)


def indexer_scores_reference(
    index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor, q_offset: int = 0
) -> torch.Tensor:
    """Full lightning-indexer score matrix (DeepSeek-V3.2), causal positions masked to ``-inf``.

    ``I[b, t, s] = sum_j index_w[b, t, j] * ReLU(index_q[b, t, j] . index_k[b, s])`` for
    ``s <= q_offset + t``. Shapes: ``[B,T,H_I,d_I]``, ``[B,T,H_I]``, ``[B,N,d_I]`` -> ``[B, T, N]``.
    """
    s = (torch.relu(torch.einsum("btjd,bsd->btjs", index_q, index_k)) * index_w[..., None]).sum(2)
    T, N = index_q.shape[1], index_k.shape[1]
    mask = torch.arange(N)[None, :] > (torch.arange(T) + q_offset)[:, None]
    return s.masked_fill(mask.to(s.device), float("-inf"))


def sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked dense softmax over the keys listed in ``idx [B, T, K]`` (``-1`` = unused slot).

    Checks ``dsa.sparse_attention``: builds the full ``[B, H, T, N]`` logits and keeps only selected keys.
    """
    B, T, H, _ = q.shape
    N, KVH = k.shape[1], k.shape[2]
    keep = torch.zeros(B, T, N + 1, dtype=torch.bool, device=q.device)
    keep.scatter_(2, torch.where(idx < 0, N, idx), True)  # -1 goes to a dropped extra column
    keep = keep[..., :N]
    kk = k.repeat_interleave(H // KVH, dim=2)
    vv = v.repeat_interleave(H // KVH, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    s = s.masked_fill(~keep[:, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), vv)


def dsa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_k: torch.Tensor,
    topk: int,
    scale: float,
    q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek sparse attention the obvious way: full indexer matrix, top-k, masked dense softmax.

    Shapes as ``dsa.indexer_topk`` / ``dsa.sparse_attention``. Returns ``(o [B,T,H,Dh], idx [B,T,K])`` with
    ``K = min(topk, N)`` and ``-1`` where a query sees fewer than ``K`` keys.
    """
    scores = indexer_scores_reference(index_q, index_w, index_k, q_offset)
    # the selection rule of dsa.indexer_topk: top-k by score, ties broken toward the most recent key
    from .dsa import TIE_BREAK

    scores = scores + torch.arange(scores.shape[-1], dtype=scores.dtype, device=scores.device) * TIE_BREAK
    val, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    idx = idx.masked_fill(torch.isneginf(val), -1)
    return sparse_attention_reference(q, k, v, idx, scale), idx


# ---- end DSA references ----
