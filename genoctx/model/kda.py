"""Kimi Delta Attention (KDA): the linear-attention mixer of GLM-5.3-Flash (34 of its 45 layers).

Kimi Linear (Moonshot AI, 2025, arXiv:2510.26692) extends the gated delta rule with a decay per key channel.
Per head, a state S in R^{dk x dv} (fp32) evolves as

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T (q_t * dk^-1/2).

Design choices:

- ``chunk_kda`` is the training and evaluation form: the WY/UT chunked algorithm of fla ``fla/ops/kda``
  written in plain PyTorch (CPU and CUDA), in its chunk-parallel form: intra-chunk work is batched over all
  chunks of a block; only the inter-chunk state recurrence is sequential (3 aten ops per chunk each way), so
  memory is linear in the sequence length. Under autograd each block is one autograd Function, ``_KDABlock``, with a
  hand-written backward (no autograd graph of the intra-chunk terms) and its recompute built in: it keeps only the
  block's inputs and entering state and reruns the block in backward. A block costs a constant number of aten ops
  (87 forward, 206 backward with its rerun, fp32) plus 3 per chunk each way (6 in the backward with the rerun).
  ``_kda_block_reference`` (the per-chunk loop under autograd, ``chunk_kda(reference_loop=True)``) is its slow
  reference.
- Every exponent is <= 0: intra-chunk decays are written as differences of cumulative log decays
  Gamma_i - Gamma_j taken only on the causal part (pairwise inside sub-chunks of 8 tokens, through a
  sub-chunk anchor between sub-chunks), so strong gates (g = -50 per step) cannot overflow. The scores of k and q
  share their decay factors and products (``_fused_scores``).
- The layer recomputes the core in backward (``recompute=True``): only q, k, v, g, beta and the state entering
  each block are kept per layer; the decay factors are recomputed, so nothing of size ``T x sub x K`` is kept.
- The slow token-by-token reference is ``genoctx.model.reference.recurrent_kda``.
- The layer follows the chunk contract: ``forward(x, cache) -> (y, cache)``; ``KDACache`` carries the
  recurrent state and the last ``conv_size - 1`` pre-convolution inputs, so k chunks of L/k tokens equal
  one pass over L tokens.
- The core that ran is recorded in ``layer.stats["path"]`` ("chunk" = ours, "fla" = fla's Triton kernel,
  used only when asked for with ``use_fla=True`` and the input is on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from genoctx.errors import GenoctxError
from genoctx.model.config import ModelConfig
from genoctx.model.precision import island

_SUB_CHUNK = 8  # tokens per sub-chunk for the pairwise (masked) decay differences (8 is fastest on CPU)


def _decay_factors(b: Tensor, G: Tensor):
    """Decay factors shared by the forward and backward of ``_CausalDecayScores`` (every exponent <= 0).

    b, G: ``[..., C, K]``. Returns ``(sub, n, bb, Ed, b_diag, row_decay, e, b_off)``: ``Ed``
    ``[..., n, sub, sub, K]`` = ``exp(G_i - G_j)`` inside sub-chunks (0 above the diagonal), ``b_diag = b_j Ed``;
    ``row_decay`` ``[..., n-1, sub, K]`` = ``exp(G_i - r_s)``, ``e`` ``[..., n-1, C, K]`` = ``exp(r_s - G_j)`` for
    columns in earlier sub-chunks (else 0), ``b_off = b * e`` (the last three None when n == 1).
    """
    *lead, C, K = b.shape
    sub = _SUB_CHUNK if C % _SUB_CHUNK == 0 else C
    n = C // sub
    bb, Gb = (x.reshape(*lead, n, sub, K) for x in (b, G))
    causal = torch.ones(sub, sub, dtype=torch.bool, device=b.device).tril()
    Ed = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill_(~causal[..., None], float("-inf")).exp_()
    b_diag = bb.unsqueeze(-3) * Ed  # [..., n, sub(i), sub(j), K]
    row_decay = e = b_off = None
    if n > 1:
        r = Gb[..., :-1, -1, :]  # [..., n-1, K] anchors for row sub-chunks 1..n-1
        row_decay = (Gb[..., 1:, :, :] - r.unsqueeze(-2)).exp_()  # [..., n-1, sub, K]
        before = torch.arange(C, device=b.device)[None, :] < (torch.arange(1, n, device=b.device)[:, None] * sub)
        e = (r.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(~before[..., None], float("-inf")).exp_()
        b_off = b.unsqueeze(-3) * e  # [..., n-1, C, K]
    return sub, n, bb, Ed, b_diag, row_decay, e, b_off


def _block_diagonal(diag: Tensor, C: int) -> Tensor:
    """``[..., n, sub, sub]`` diagonal blocks -> ``[..., n, sub, C]`` rows with the blocks on the diagonal."""
    *lead, n, sub, _ = diag.shape
    A = diag.new_zeros(*lead, n, sub, n, sub)
    A.diagonal(dim1=-4, dim2=-2).copy_(diag.movedim(-3, -1))
    return A.view(*lead, n, sub, C)


class _CausalDecayScores(torch.autograd.Function):
    """``A[..., i, j] = sum_d a_id b_jd exp(G_id - G_jd)`` (j <= i, else 0) for several ``a``, one autograd node.

    Backward recomputes the decay factors (nothing of size ``C x sub x K`` is saved) and uses
    ``da_i = sum_j dA_ij b_j e^{G_i - G_j}``, ``db_j = sum_i dA_ij a_i e^{G_i - G_j}`` (the same causal
    decayed products, transposed) and ``dG = sum_a a * da - b * db`` (A depends on G only via G_i - G_j).
    """

    @staticmethod
    def forward(ctx, b, G, *rows):
        ctx.save_for_backward(b, G, *rows)
        return _causal_decay_scores_forward(b, G, rows)

    @staticmethod
    def backward(ctx, *dAs):
        b, G, *rows = ctx.saved_tensors
        return _causal_decay_scores_backward(b, G, rows, dAs)


def _causal_decay_scores_forward(b: Tensor, G: Tensor, rows) -> tuple:
    """The forward of ``_CausalDecayScores`` without autograd: one ``[..., C, C]`` score matrix per row tensor."""
    C = b.shape[-2]
    sub, n, _, _, b_diag, row_decay, _, b_off = _decay_factors(b, G)
    out = []
    for a in rows:
        ab = a.reshape(*a.shape[:-2], n, sub, a.shape[-1])
        A = _block_diagonal((b_diag * ab.unsqueeze(-2)).sum(-1), C)  # [..., n, sub, C]
        if n > 1:
            A[..., 1:, :, :] += (ab[..., 1:, :, :] * row_decay) @ b_off.transpose(-1, -2)
        out.append(A.reshape(*a.shape[:-1], C))
    return tuple(out)


def _causal_decay_scores_backward(b: Tensor, G: Tensor, rows, dAs) -> tuple:
    """The backward of ``_CausalDecayScores`` (its decay factors recomputed): ``(db, dG, *da)`` for the rows' score
    gradients ``dAs`` (``[..., C, C]`` or None each); shapes as its forward's inputs."""
    *lead, C, K = b.shape
    sub, n, bb, Ed, b_diag, row_decay, e, b_off = _decay_factors(b, G)
    g_bdiag = torch.zeros_like(b_diag) if any(d is not None for d in dAs) else None
    g_boff = torch.zeros_like(b_off) if n > 1 else None
    grads, dG = [], torch.zeros_like(G)
    for a, dA in zip(rows, dAs, strict=True):
        if dA is None:
            grads.append(None)
            continue
        ab = a.reshape(*lead, n, sub, K)
        dAr = dA.reshape(*lead, n, sub, n, sub)
        dAd = dAr.diagonal(dim1=-4, dim2=-2).movedim(-1, -3).contiguous()  # [..., n, sub(i), sub(j)]
        da = (dAd.unsqueeze(-1) * b_diag).sum(-2)  # [..., n, sub, K]
        g_bdiag.add_(dAd.unsqueeze(-1) * ab.unsqueeze(-2))
        if n > 1:
            d_off = dA.reshape(*lead, n, sub, C)[..., 1:, :, :].contiguous()  # [..., n-1, sub, C]
            a_dec = ab[..., 1:, :, :] * row_decay
            da[..., 1:, :, :] += (d_off @ b_off) * row_decay
            g_boff.add_(d_off.transpose(-1, -2) @ a_dec)
        da = da.reshape(a.shape)
        dG.add_(a * da)
        grads.append(da)
    db = (g_bdiag * Ed).sum(-3).reshape(b.shape)
    if n > 1:
        db += (g_boff * e).sum(-3)
    dG.sub_(b * db)
    return (db, dG, *grads)


def _causal_decay_scores(rows: tuple[Tensor, ...], b: Tensor, G: Tensor) -> list[Tensor]:
    """For each ``a`` in ``rows``: ``A[..., i, j] = sum_d a_id b_jd exp(G_id - G_jd)`` for ``j <= i``, else 0.

    a, b, G: ``[..., C, K]``; G is non-increasing along C (a cumulative sum of log decays), so the causal
    part has exponents <= 0. Inside sub-chunks of ``_SUB_CHUNK`` tokens the differences are formed
    pairwise and masked to the causal part before ``exp``; between sub-chunks a row sub-chunk ``s`` uses
    the anchor ``r = G`` at the last token of sub-chunk ``s - 1``: ``exp(G_i - r) * exp(r - G_j)``, both
    factors <= 1. Memory per chunk is ``C * (sub + C / sub) * K`` rather than ``C * C * K``, and only while
    the node runs: backward recomputes the factors (``_CausalDecayScores``) and saves only a, b, G.

    Returns a list of ``[..., C, C]`` tensors in b's dtype.
    """
    # a row that is b itself goes in as a view of it (autograd sums both gradients into b, as for the same tensor
    # twice): torch.compile cannot trace one tensor passed to two inputs of an autograd.Function
    return list(_CausalDecayScores.apply(b, G, *(a.view_as(a) if a is b else a for a in rows)))


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
    block_tokens: int | None = None,
    recompute: bool = False,
    reference_loop: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Kimi Delta Attention in the chunked WY/UT form (Kimi Linear, 2025; fla ``chunk_kda``).

    Per chunk of C tokens with Gamma = cumulative sum of g inside the chunk:
    ``A_kk[i,j] = beta_i sum_d k_id k_jd e^{Gamma_id - Gamma_jd}`` (j < i);
    ``W = (I + A_kk)^-1 Diag(beta) (e^Gamma * K)``, ``U = (I + A_kk)^-1 Diag(beta) V`` (triangular solve);
    ``V' = U - W S``; ``O = (Q e^Gamma) S + A_qk V'`` with
    ``A_qk[i,j] = sum_d q_id k_jd e^{Gamma_id - Gamma_jd}`` (j <= i);
    ``S <- Diag(e^{Gamma_C}) S + (e^{Gamma_C - Gamma} * K)^T V'``. All exponents are <= 0.

    The sequence runs in blocks of ``block_tokens`` tokens (whole chunks), the state S passed from block to
    block; the intra-chunk work of a block is batched over its chunks, so the working set (forward, and the
    backward's recomputed decay factors) is bounded by the block, not the sequence. Under autograd each block is one
    node (``_KDABlock``, a hand-written backward). With ``recompute`` the graph keeps only the block inputs (views
    of q, k, v, g, beta) and the state entering each block; backward recomputes one block at a time, last block
    first, each taking the gradient its successor sent into its outgoing state.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log decay per key channel (<= 0; natural-log units per token).
        beta: ``[B, T, H]`` delta-rule write strength.
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state from the previous chunk, or None (zeros).
        output_final_state: return the final state (else None).
        chunk_size: tokens per chunk C. T need not be a multiple (padded internally with k = 0, beta = 0,
            g = 0, which leave the state unchanged, then cut).
        block_tokens: tokens per block (rounded down to a multiple of C, at least C); None = one block.
        recompute: keep only each block's inputs and rerun it in backward (only when grad is enabled; the reference
            loop as a ``torch.utils.checkpoint``).
        reference_loop: run each block as ``_kda_block_reference`` (the per-chunk loop differentiated by autograd,
            the slow reference of the chunk-parallel ``_kda_block``; same numbers to rounding).

    Returns:
        ``(o, S)``: ``o`` ``[B, T, H, V]`` in ``v.dtype``; ``S`` ``[B, H, K, V]`` in fp32 (fp64 when q is
        fp64), or None. Computed in fp32 (fp64 for fp64 inputs) with autocast disabled; gradients flow to
        every input, including ``initial_state``. Memory is linear in T (the output and, with ``recompute``,
        one state per block); the working set is that of one block.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size`` or ``block_tokens``.
    """
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"q, k, g must share shape [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}"
        )
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}]; got {tuple(beta.shape)}")
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {V}]; got {tuple(initial_state.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if block_tokens is not None and block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if scale is None:
        scale = K**-0.5
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = chunk_size
    block = T if block_tokens is None else max(C, block_tokens // C * C)
    with torch.autocast(device_type=q.device.type, enabled=False):
        # the entering state as given (in ct): every block returns a new state, so the caller's is never written
        S = q.new_zeros(B, H, K, V, dtype=ct) if initial_state is None else initial_state.to(ct)
        if T == 0:
            return v.new_zeros(B, 0, H, V), (S.clone() if output_final_state else None)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, S))
        outs = []
        # split once: slicing per block would make autograd write a full-size zero gradient of each input per
        # block (quadratic in T); split's backward concatenates the blocks' gradients once (one block: no split)
        parts = [x.split(block, dim=1) for x in (q, k, v, g, beta)] if block < T else [(x,) for x in (q, k, v, g, beta)]
        blocks = zip(*parts, strict=True)
        for qb, kb, vb, gb, bb in blocks:
            args = (qb, kb, vb, gb, bb, S, scale, C)
            if reference_loop and recompute and grad:
                o, S = checkpoint(_kda_block_reference, *args, use_reentrant=False)
            elif reference_loop:
                o, S = _kda_block_reference(*args)
            elif grad:
                o, S = _KDABlock.apply(*args, recompute)
            else:
                o, S, _ = _kda_block(*args, False)
                o = o.to(v.dtype)
            outs.append(o)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return o, (S if output_final_state else None)


def _from_chunks(x: Tensor, T: int) -> Tensor:
    """``[N, B, H, C, D]`` -> ``[B, T, H, D]`` (the block layout back to the token layout, the pad cut)."""
    N, B, H, C, D = x.shape
    x = x.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, D)
    return x[:, :T] if N * C > T else x


def _to_chunks(x: Tensor, N: int, C: int) -> Tensor:
    """``[B, T, H, D]`` -> ``[N B H, C, D]`` (chunk n of head (b, h) at row ``(n B + b) H + h``), contiguous, T padded
    with zeros to ``N C``."""
    B, T, H, D = x.shape
    if N * C > T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    return x.view(B, N, C, H, D).permute(1, 0, 3, 2, 4).contiguous().view(N * B * H, C, D)


def _decay_factors_flat(b: Tensor, G: Tensor, part: str = "both") -> tuple:
    """The decay factors of ``_fused_scores`` (every exponent <= 0), b, G ``[P, C, K]``: ``(sub, n, Ed, b_diag, rd, e,
    b_off)``: ``Ed [P, n, sub, sub, K] = exp(G_i - G_j)`` inside sub-chunks of ``sub`` tokens (0 above the diagonal),
    ``b_diag = b_j Ed``; with ``n > 1`` sub-chunks the anchors ``r_s`` (G at the last token of sub-chunk ``s - 1``, 0
    for ``s = 0``), ``rd [P, n, sub, K] = exp(G_i - r_s)``, ``e [P, n, C, K] = exp(r_s - G_j)`` for columns in earlier
    sub-chunks (else 0) and ``b_off = b e`` (else None). Sub-chunk 0's row of ``e`` is all 0: its product costs
    ``1 / n`` more FLOPs and saves every slice. ``part``: "diag" (the last three None), "off" (Ed, b_diag None) or
    "both"."""
    P, C, K = b.shape
    sub = _SUB_CHUNK if C % _SUB_CHUNK == 0 else C
    n = C // sub
    Gb = G.view(P, n, sub, K)
    Ed = b_diag = rd = e = b_off = None
    if part != "off":
        upper = torch.ones(sub, sub, dtype=torch.bool, device=b.device).triu_(1).unsqueeze_(-1)  # [i, j, 1]: j > i
        Ed = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill_(upper, float("-inf")).exp_()
        b_diag = b.view(P, n, 1, sub, K) * Ed
    if n > 1 and part != "diag":
        r = F.pad(Gb[:, :-1, -1], (0, 0, 1, 0))  # [P, n, K]
        rd = (Gb - r.unsqueeze(2)).exp_()
        later = torch.ones(n, n, dtype=torch.bool, device=b.device).triu_().view(n, n, 1, 1)  # [s, t, 1, 1]: t >= s
        e = (r.view(P, n, 1, 1, K) - Gb.unsqueeze(1)).masked_fill_(later, float("-inf")).exp_().view(P, n, C, K)
        b_off = b.unsqueeze(1) * e
    return sub, n, Ed, b_diag, rd, e, b_off


def _fused_scores(a: Tensor, b: Tensor, G: Tensor, keep: bool) -> tuple[Tensor, tuple | None]:
    """``A[p, i, r, j] = sum_d a[p, i, r, d] b[p, j, d] exp(G[p, i, d] - G[p, j, d])`` for ``j <= i`` (else 0), for R
    rows ``a [P, C, R, K]`` at once (KDA's ``A_kk`` and ``A_qk``: one product for both); b, G ``[P, C, K]``, G
    non-increasing along C. Inside sub-chunks ``a (b_j e^{G_i - G_j})`` (one bmm); between sub-chunks
    ``(a e^{G_i - r_s}) (b e^{r_s - G_j})^T`` (one bmm), every factor <= 1 (``_decay_factors_flat``). Returns
    ``(A [P, C, R, C], the decay factors if keep else None)``; without ``keep`` the factors inside sub-chunks are
    freed before those between them are made. The math of ``_causal_decay_scores`` (its slow twin, one row at a
    time)."""
    P, C, R, K = a.shape
    sub, n, Ed, b_diag, *_ = _decay_factors_flat(b, G, "diag")
    diag = torch.bmm(a.view(P * C, R, K), b_diag.view(P * C, sub, K).transpose(1, 2))  # [P C, R, sub]
    if not keep:
        Ed = b_diag = None
    if n == 1:
        return diag.view(P, C, R, C), ((sub, n, Ed, b_diag, None, None, None) if keep else None)
    _, _, _, _, rd, e, b_off = _decay_factors_flat(b, G, "off")
    a_dec = (a.view(P, n, sub, R, K) * rd.view(P, n, sub, 1, K)).view(P * n, sub * R, K)
    A = torch.bmm(a_dec, b_off.view(P * n, C, K).transpose(1, 2))  # [P n, sub R, C]
    A.view(P, n, sub, R, n, sub).diagonal(dim1=1, dim2=4).add_(diag.view(P, n, sub, R, sub).permute(0, 2, 3, 4, 1))
    return A.view(P, C, R, C), ((sub, n, Ed, b_diag, rd, e, b_off) if keep else None)


def _fused_scores_backward(a: Tensor, b: Tensor, fac: tuple, dA: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``_fused_scores`` (a ``[P, C, R, K]``, b ``[P, C, K]``, dA ``[P, C, R, C]``, zero above the
    diagonal): ``(da [P, C, R, K], db [P, C, K], dG [P, C, K])`` from ``da_i = sum_j dA_ij b_j e^{G_i - G_j}``,
    ``db_j = sum_i dA_ij a_i e^{G_i - G_j}`` (the same decayed products, transposed) and
    ``dG = sum_r a da - b db`` (A depends on G only through G_i - G_j)."""
    sub, n, Ed, b_diag, rd, e, b_off = fac
    P, C, R, K = a.shape
    dAd = dA.view(P, n, sub, R, n, sub).diagonal(dim1=1, dim2=4) if n > 1 else dA.view(P, 1, sub, R, sub, 1)[..., 0]
    dAd = dAd.permute(0, 4, 1, 2, 3) if n > 1 else dAd  # [P, n, sub(i), R, sub(j)]
    dAd = dAd.reshape(P * C, R, sub)
    da = torch.bmm(dAd, b_diag.view(P * C, sub, K))  # [P C, R, K]
    g_bdiag = torch.bmm(dAd.transpose(1, 2), a.view(P * C, R, K))  # [P C, sub(j), K]
    db = (g_bdiag.view(P, n, sub, sub, K) * Ed).sum(2).view(P, C, K)
    if n > 1:
        dAo = dA.view(P * n, sub * R, C)
        rd5 = rd.view(P, n, sub, 1, K)
        da.view(P, n, sub, R, K).addcmul_(torch.bmm(dAo, b_off.view(P * n, C, K)).view(P, n, sub, R, K), rd5)
        a_dec = (a.view(P, n, sub, R, K) * rd5).view(P * n, sub * R, K)
        g_boff = torch.bmm(dAo.transpose(1, 2), a_dec)  # [P n, C, K]
        db += (g_boff.view(P, n, C, K) * e).sum(1)
    da = da.view(P, C, R, K)
    dG = (a * da).sum(2).sub_(b * db)
    return da, db, dG


def _kda_block(q, k, v, g, beta, S: Tensor, scale: float, C: int, keep: bool):
    """One block of ``chunk_kda`` in the chunk-parallel form, no autograd (autocast already off): q, k, g
    ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, the entering state S ``[B, H, K, V]`` (fp32 or fp64: the
    compute dtype) -> ``(o [B, T, H, V] in the compute dtype, the leaving state, terms)``; ``terms`` (with ``keep``,
    else None) is what ``_block_backward`` needs. T is padded to whole chunks of C (k = beta = g = 0) and the pad cut.

    The inputs are packed into one ``[k | q | g | v | beta]`` tensor in the block layout ``[N B H, C, 3K + V + 1]``;
    every chunk's intra-chunk terms (the decay scores of k and q in one ``_fused_scores``, the triangular solve,
    decayed queries and keys) are batched over the block's N chunks; only the state recurrence runs chunk by chunk
    (``_scan_forward``, 3 aten ops per chunk). q enters unscaled: the output is scaled at the end (``O`` is linear
    in q). The same math as ``_kda_block_reference`` (the per-chunk loop under autograd), in another order of sums.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    ct = S.dtype
    N = -(-T // C)
    X = _to_chunks(torch.cat([k, q, g, v, beta.unsqueeze(-1)], dim=-1).to(ct), N, C)  # [P, C, 3K + V + 1]
    P = X.shape[0]
    k, q, g, v, beta = X.split([K, K, K, V, 1], dim=-1)
    a = X[..., : 2 * K].view(P, C, 2, K)  # rows k | q
    G = g.cumsum(1)
    eG = G.exp()
    A, fac = _fused_scores(a, k, G, keep)  # [P, C, 2, C]: A_kk (with its diagonal, which the solve ignores) | A_qk
    A_kk, A_qk = A.unbind(2)
    L = A_kk * beta  # the strictly lower part of the unitriangular I + A_kk
    X0 = torch.cat([eG * k, v], dim=-1)
    WU = torch.linalg.solve_triangular(L, beta * X0, upper=False, unitriangular=True)
    W, U = WU.split([K, V], dim=-1)
    q_dec = q * eG  # query against the state at the chunk start
    G_last = G[:, -1:]
    Ek = (G_last - G).exp_()
    k_dec = k * Ek  # key decayed to the chunk end
    decay = G_last.exp().transpose(1, 2)  # [P, K, 1]
    o, S, Sin, Vn = _scan_forward(W, U, q_dec, k_dec, A_qk, decay, S.reshape(B * H, K, V))
    S = S.view(B, H, K, V)
    island("kda.state", S)
    terms = (X, G, eG, fac, A, L, X0, WU, Ek, q_dec, k_dec, decay, Sin, Vn) if keep else None
    return _from_chunks(o.mul_(scale).view(N, B, H, C, V), T), S, terms


def _block_backward(terms, shape: tuple, scale: float, dO: Tensor | None, dSf: Tensor | None, need_S0: bool):
    """Gradients of one block from ``_kda_block``'s ``terms``, ``shape = (B, T, H, K)``, dO ``[B, T, H, V]``
    and dSf ``[B, H, K, V]`` (each None when it got no gradient): ``(dX [B, T, H, 3K + V + 1], dS0)``: the packed
    gradient ``[dk | dq | dg | dv | dbeta]`` in the compute dtype and dS0 ``[B H, K, V]`` or None.

    Written out from the forward (Kimi Linear, arXiv:2510.26692; fla ``chunk_kda_bwd``): the scan's backward
    (``_scan_backward``, fed ``scale dO``) gives dW, dU, dQd, dKd, dA_qk, d decay and dS_0; ``WU = L^-1 Diag(beta)
    X0`` gives ``dR = L^-T dWU`` (one triangular solve), ``dL = -tril(dR WU^T, -1)``, ``dX0 = beta dR`` and
    ``dbeta = sum_c dR X0 + sum_j dL A_kk``; ``Qd = q e^G``, ``Kd = k e^{G_C - G}``, ``decay = e^{G_C}`` and
    ``X0 = [e^G k | v]`` are products; the decay scores' backward (``_fused_scores_backward``) takes
    ``dA_kk = beta dL`` and dA_qk; ``dg`` is the reverse cumulative sum of dG (``G = cumsum g``)."""
    X, G, eG, fac, A, L, X0, WU, Ek, q_dec, k_dec, decay, Sin, Vn = terms
    B, T, H, K = shape
    P, C, F_ = X.shape
    V = WU.shape[-1] - K
    k, q, g, v, beta = X.split([K, K, K, V, 1], dim=-1)
    a = X[..., : 2 * K].view(P, C, 2, K)
    M = B * H
    N = P // M
    dOc = None if dO is None else _to_chunks(dO.to(X.dtype), N, C).mul_(scale)
    dSf = None if dSf is None else dSf.reshape(M, K, V)
    A_kk, A_qk = A.unbind(2)
    need = (True, True, True, True, True, True, need_S0)
    dW, dU, dQd, dKd, dA_qk, dD, dS0 = _scan_backward(WU[..., :K], q_dec, k_dec, A_qk, decay, Sin, Vn, N, dOc, dSf,
                                                      need)  # fmt: skip
    dR = torch.linalg.solve_triangular(L.transpose(1, 2), torch.cat([dW, dU], dim=-1), upper=True, unitriangular=True)
    dL = torch.bmm(dR, WU.transpose(1, 2)).tril_(-1).neg_()
    dbeta = (dR * X0).sum(-1, keepdim=True).add_((dL * A_kk).sum(-1, keepdim=True))
    dek, dv = dR.mul_(beta).split([K, V], dim=-1)
    dk = dek * eG
    dG = dek * X0[..., :K]
    dG.addcmul_(dQd, q_dec)
    dq = dQd * eG
    if dKd is not None:
        t = dKd * k_dec
        dk.addcmul_(dKd, Ek)
        dG.sub_(t)
        dG[:, -1:] += t.sum(1, keepdim=True).addcmul_(dD.transpose(1, 2), decay.transpose(1, 2))
    if fac is None:
        fac = _decay_factors_flat(k, G)
    dA = torch.cat([dL.mul_(beta).unsqueeze(2), dA_qk.unsqueeze(2)], dim=2)  # [P, C, 2, C]: dA_kk | dA_qk
    da, db, dGs = _fused_scores_backward(a, k, fac, dA)
    dk += db
    dG += dGs
    dkq = da.view(P, C, 2 * K).add_(torch.cat([dk, dq], dim=-1))
    dg = dG.flip(1).cumsum(1).flip(1)
    dX = torch.cat([dkq, dg, dv, dbeta], dim=-1)
    return _from_chunks(dX.view(N, B, H, C, F_), T), dS0


class _KDABlock(torch.autograd.Function):
    """One block of ``chunk_kda`` as one autograd node: forward ``_kda_block``, backward ``_block_backward``
    (hand-written; no autograd graph of the intra-chunk terms, no ``torch.utils.checkpoint``).

    Inputs: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, the entering state ``S0 [B, H, K, V]``
    (compute dtype), scale (float), C (int), recompute (bool). Outputs ``(o [B, T, H, V] in v's dtype, S [B, H, K,
    V])``. With ``recompute`` the node saves only its inputs (q, k, v, g, beta as given, usually views of the layer's
    tensors, and S0) and reruns ``_kda_block`` in backward (one block's working set at a time, the decay factors
    of the rerun kept for the scores' backward), as ``torch.utils.checkpoint`` did; without it, it saves the
    forward's terms (about what autograd kept of ``_kda_block_reference``'s intra-chunk terms) and recomputes only
    the decay factors.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, scale, C, recompute):
        o, S, terms = _kda_block(q, k, v, g, beta, S0, scale, C, not recompute)
        ctx.set_materialize_grads(False)
        ctx.scale, ctx.C, ctx.recompute = scale, C, recompute
        ctx.dtypes = tuple(x.dtype for x in (k, q, g, v, beta))
        ctx.shape, ctx.V = tuple(q.shape), v.shape[-1]
        if recompute:
            ctx.save_for_backward(q, k, v, g, beta, S0)
        else:
            ctx.fac = None
            ctx.save_for_backward(*(t for i, t in enumerate(terms) if i != 3))
        return o.to(v.dtype), S

    @staticmethod
    def backward(ctx, dO, dS):
        if dO is None and dS is None:
            return (None,) * 9
        if ctx.recompute:
            _, _, terms = _kda_block(*ctx.saved_tensors, ctx.scale, ctx.C, True)
        else:
            terms = list(ctx.saved_tensors)
            terms.insert(3, None)
        B, T, H, K = ctx.shape
        dX, dS0 = _block_backward(terms, ctx.shape, ctx.scale, dO, dS, ctx.needs_input_grad[5])
        dk, dq, dg, dv, dbeta = (
            x.to(d) for x, d in zip(dX.split([K, K, K, ctx.V, 1], dim=-1), ctx.dtypes, strict=True)
        )
        return dq, dk, dv, dg, dbeta.squeeze(-1), None if dS0 is None else dS0.view(B, H, K, -1), None, None, None


def _scan_forward(W, U, Qd, Kd, A, decay, S0):
    """The inter-chunk state recurrence, forward (shapes and math in ``_scan_backward``): ``(O, S_N, Sin, Vn)``, with
    the entering states and ``V'`` that the backward uses; the number of chunks is ``W.shape[0] // S0.shape[0]``."""
    M = S0.shape[0]
    KdT = Kd.transpose(1, 2)
    S, states, vs = S0, [], []
    for W_n, U_n, KdT_n, d_n in zip(W.split(M), U.split(M), KdT.split(M), decay.split(M), strict=True):
        states.append(S)
        v_n = torch.baddbmm(U_n, W_n, S, alpha=-1)
        vs.append(v_n)
        S = torch.baddbmm(S * d_n, KdT_n, v_n)
    Sin, Vn = torch.cat(states), torch.cat(vs)  # [N M, K, V], [N M, C, V]
    O = torch.baddbmm(torch.bmm(Qd, Sin), A, Vn)
    return O, S, Sin, Vn


def _scan_backward(W, Qd, Kd, A, decay, Sin, Vn, N: int, dO, dSf, need):
    """The backward of the inter-chunk state recurrence (``_scan_forward``), the only sequential part of chunked KDA.

    Inputs, one block of N chunks of C tokens on M = B H heads, each ``[N M, ., .]`` with chunk n at rows
    ``n M .. (n+1) M`` (fp32 or fp64): W ``[N M, C, K]``, U ``[N M, C, V]`` (the WY/UT terms), ``Qd = Q e^Gamma``
    ``[N M, C, K]``, ``Kd = e^{Gamma_C - Gamma} K`` ``[N M, C, K]``, ``A_qk`` ``[N M, C, C]``, ``decay = e^{Gamma_C}``
    ``[N M, K, 1]``, the entering state ``S_0`` ``[M, K, V]``, and N (int). Forward (``_scan_forward``), per chunk
    (3 aten ops)::

        V'_n = U_n - W_n S_n ;   S_{n+1} = decay_n * S_n + Kd_n^T V'_n

    then for all chunks at once ``O = Qd S_n + A_qk V'`` (bmm, baddbmm): ``(O [N M, C, V], S_N [M, K, V])``.
    Backward, per chunk in reverse (3 aten ops, 2 when the final state got no gradient)::

        dV'_n = [A_qk^T dO]_n + Kd_n dS_{n+1} ;   dS_n = decay_n * dS_{n+1} + [Qd^T dO]_n - W_n^T dV'_n

    with the bracketed products batched before the loop, then batched after it: ``dW = -dV' S^T``,
    ``dQd = dO S^T``, ``dKd = V' dS_{n+1}^T``, ``dA_qk = dO V'^T``, ``d decay = sum_V dS_{n+1} * S_n``, ``dU = dV'``.
    The FLOPs are autograd's of ``_kda_block_reference`` (``genoctx.plan.flops._kda_core``): chunk 0's
    ``Qd^T dO`` and ``W^T dV'`` are skipped when ``S_0`` needs no gradient, the last chunk's ``Kd`` products when
    the final state gets none.

    Memory: the backward needs the entering states ``S_n`` of the block's chunks (``N M K V`` elements: ``H K V / C``
    per token, what the reference loop's graph kept too) and ``V'`` (``N M C V``) beside the forward's inputs.
    Math: Kimi Linear (arXiv:2510.26692) section 3 / fla ``chunk_kda`` (its ``chunk_gated_delta_rule_fwd_h`` and
    ``_bwd_dhu``).

    ``need``: which of (W, U, Qd, Kd, A_qk, decay, S_0) need a gradient (7 bools); dO or dSf may be None (no
    gradient). Returns ``(dW, dU, dQd, dKd, dA_qk, d decay, dS_0)``, None where not needed.
    """
    M = Sin.shape[0] // N
    if dO is None:
        dO = torch.zeros_like(Vn)
    first = 0 if need[6] else 1  # chunk 0's dS_0 only when S_0 needs a gradient
    P = torch.bmm(A.transpose(1, 2), dO).split(M)  # [A_qk^T dO]_n
    R = torch.bmm(Qd[M:].transpose(1, 2), dO[M:]) if first else torch.bmm(Qd.transpose(1, 2), dO)
    R = (None,) * first + R.split(M)  # [Qd^T dO]_n
    WT, Ks, Ds = W.transpose(1, 2).split(M), Kd.split(M), decay.split(M)
    dv, dS = [None] * N, [None] * N + [dSf]
    for n in range(N - 1, -1, -1):
        dn = dS[n + 1]
        dv[n] = P[n] if dn is None else torch.baddbmm(P[n], Ks[n], dn)
        if n >= first:
            r = R[n] if dn is None else torch.addcmul(R[n], Ds[n], dn)
            dS[n] = torch.baddbmm(r, WT[n], dv[n], alpha=-1)
    dV = torch.cat(dv)  # [N M, C, V]
    dW = dQd = dKd = dA = dD = None
    if need[0]:  # beta = 0: W only gives the shape (the product alone, negated)
        dW = torch.baddbmm(W, dV, Sin.transpose(1, 2), beta=0, alpha=-1)
    if need[2]:
        dQd = torch.bmm(dO, Sin.transpose(1, 2))
    if need[4]:
        dA = torch.bmm(dO, Vn.transpose(1, 2))
    if need[3] or need[5]:
        # the states leaving chunks 0..N-1 got dS_1..dS_N; without a final-state gradient the last chunk's
        # Kd and decay get none (zero rows)
        last = N if dSf is not None else N - 1
        if last:
            dnext = torch.cat(dS[1 : last + 1])  # [last M, K, V]
            if need[3]:
                dKd = torch.bmm(Vn[: last * M] if last < N else Vn, dnext.transpose(1, 2))
            if need[5]:
                dD = (dnext * (Sin[: last * M] if last < N else Sin)).sum(-1, keepdim=True)
            if last < N:
                dKd = None if dKd is None else F.pad(dKd, (0, 0, 0, 0, 0, M))
                dD = None if dD is None else F.pad(dD, (0, 0, 0, 0, 0, M))
    return dW, dV if need[1] else None, dQd, dKd, dA, dD, dS[0] if need[6] else None


def _kda_block_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, scale: float, C: int):
    """The slow reference of ``_kda_block`` (``chunk_kda(reference_loop=True)``): the inter-chunk recurrence as a
    Python loop of 5-D products differentiated by autograd (~20 aten ops per chunk forward, ~40 backward).

    One block of ``chunk_kda`` (its formulas; autocast already off): q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]``, the entering state S ``[B, H, K, V]`` (fp32 or fp64: the compute dtype) -> ``(o [B, T, H, V]
    in v's dtype, the leaving state)``. T is padded to whole chunks of C (k = beta = g = 0) and the pad cut."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    ct = S.dtype
    out_dtype = v.dtype
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        x = F.pad(x.to(ct), (0, 0, 0, 0, 0, pad))
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta = F.pad(beta.to(ct), (0, 0, 0, pad)).reshape(B, N, C, H).permute(0, 3, 1, 2)  # [B, H, N, C]
    G = g.cumsum(-2)
    eG = G.exp()
    A_kk, A_qk = _causal_decay_scores((k, q), k, G)
    A_kk = A_kk.tril(-1) * beta[..., None]
    eye = torch.eye(C, dtype=ct, device=q.device)
    rhs = beta[..., None] * torch.cat([eG * k, v], dim=-1)
    WU = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    W, U = WU.split([K, V], dim=-1)
    q_dec = q * eG  # query against the state at the chunk start
    G_last = G[..., -1:, :]
    k_dec = k * (G_last - G).exp()  # key decayed to the chunk end
    state_decay = G_last.squeeze(-2).exp()[..., None]  # [B, H, N, K, 1]
    # unbind once: indexing [:, :, n] inside the loop would make autograd write a full-size zero
    # gradient per chunk (quadratic in T); unbind's backward stacks the per-chunk gradients once.
    wq = torch.cat([W, q_dec], dim=-2)  # [B, H, N, 2C, K]: one product with S gives W S and Q S
    per_chunk = (t.unbind(2) for t in (wq, U, A_qk, state_decay, k_dec))
    outs = []
    for wq_n, U_n, A_n, decay_n, k_n in zip(*per_chunk, strict=True):
        WS, QS = (wq_n @ S).split(C, dim=-2)
        v_new = U_n - WS
        outs.append(QS + A_n @ v_new)
        S = decay_n * S + k_n.transpose(-1, -2) @ v_new
    island("kda.state", S)
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S


@dataclass
class KDACache:
    """What a KDA layer carries from one chunk of the sequence to the next (the chunk contract)."""

    state: Tensor  # [B, H, K, V] fp32 recurrent state
    conv_state: Tensor  # [B, conv_size - 1, 3 * H * K]: last pre-convolution inputs of q, k, v


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (transformers ``glm5_next.l2norm``, fla's l2norm)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class ForgetGate(nn.Module):
    """Per-channel log decay of KDA (``Glm5NextTextForgetGate``), fp32.

    ``f = f_b_proj(f_a_proj(x)) + dt_bias``; with ``linear_lower_bound`` (the safe gate)
    ``g = lower_bound * sigmoid(exp(A_log) * f)``, else ``g = -exp(A_log) * softplus(f)``. ``dt_bias`` and
    ``A_log`` are fp32 islands.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Dh = cfg.linear_num_heads, cfg.linear_head_dim
        self.n_heads, self.head_dim = H, Dh
        self.lower_bound = cfg.linear_lower_bound
        self.f_a_proj = nn.Linear(cfg.hidden_size, Dh, bias=False)
        self.f_b_proj = nn.Linear(Dh, H * Dh, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H * Dh))
        self.A_log = nn.Parameter(torch.empty(H))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    @torch.no_grad()
    def reset_parameters(self, init_std: float) -> None:
        """As the reference's ``_init_weights``: A_log = 0 with the safe gate (else log U(1, 16)); dt_bias =
        softplus^-1(dt), dt log-uniform in [1e-3, 0.1]; projections N(0, init_std)."""
        for lin in (self.f_a_proj, self.f_b_proj):
            nn.init.normal_(lin.weight, std=init_std)
        if self.lower_bound is not None:
            self.A_log.zero_()
        else:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1))).clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def pre_activation(self, x: Tensor) -> Tensor:
        """``f_b_proj(f_a_proj x)`` as ``[B, T, H, K]`` in x's compute dtype: the gate before ``dt_bias`` and the
        activation (fla's raw ``g`` when fla computes the gate in its kernel, ``fla_gate_kwargs``)."""
        B, T, _ = x.shape
        return self.f_b_proj(self.f_a_proj(x)).view(B, T, self.n_heads, self.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        """x ``[B, T, D]`` -> g ``[B, T, H, K]`` fp32 (fp64 for fp64 input), every entry <= 0."""
        B, T, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x))
        with torch.autocast(device_type=x.device.type, enabled=False):
            ct = torch.float64 if x.dtype == torch.float64 else torch.float32
            f = (f.to(ct) + self.dt_bias.to(ct)).view(B, T, self.n_heads, self.head_dim)
            rate = self.A_log.to(ct).exp().view(1, 1, self.n_heads, 1)
            if self.lower_bound is not None:
                return island("kda.gate", self.lower_bound * torch.sigmoid(rate * f))
            return island("kda.gate", -rate * F.softplus(f, threshold=20.0))


FLA_SAFE_GATE_RANGE = (-5.0, 0.0)  # fla chunk_kda's safe_gate needs lower_bound in [-5, 0)


def fla_gate_kwargs(gate: ForgetGate, raw: Tensor | None = None) -> dict:
    """Keyword arguments that make fla-core's ``chunk_kda`` (``fla.ops.kda``, Triton, CUDA) apply GLM-5.3-Flash's
    forget gate (``ForgetGate``), in one of two forms:

    - ``raw is None``: fla gets our precomputed ``g = gate(x)`` ``[B, T, H, K]`` as its ``g``. Returns
      ``{"safe_gate": True, "lower_bound": lb}`` when the gate has a lower bound in fla's safe range ``[-5, 0)``
      (``g`` then lies in ``[lower_bound, 0]``, the bounded gates fla's M=16 tensor-core path requires), else
      ``{}``. fla 0.6 requires ``lower_bound`` with ``safe_gate`` only when it computes the gate itself; for
      precomputed gates "the caller must provide pre-computed bounded gates" and fla reads the bound nowhere, so
      passing it changes no result: it states the bound the gates obey (``tests/kernels/test_kda_fla.py``).
    - ``raw = gate.pre_activation(x)`` (no ``dt_bias``): fla computes the gate inside its kernel. Returns
      ``{"g": raw, "use_gate_in_kernel": True, "A_log": [H] fp32, "dt_bias": [H K] fp32, "lower_bound": lb}``
      (plus ``"safe_gate": True`` in the safe range): fla's ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``,
      or without a lower bound ``-exp(A_log) softplus(g + dt_bias)``, which is ``ForgetGate.forward``.

    Tested on CPU (``tests/kernels/test_kda_fla.py``) against fla's naive gate references
    (``naive_kda_lowerbound_gate``, ``naive_kda_gate``), its naive recurrent and chunk forms, its Triton
    ``fused_recurrent_kda`` (same gate arguments; under the Triton interpreter) and ``chunk_kda`` here. fla's
    ``chunk_kda`` itself does not run under the interpreter (fla 0.6: a loop index is a Python int there).
    """
    lb = gate.lower_bound
    safe = lb is not None and FLA_SAFE_GATE_RANGE[0] <= lb < FLA_SAFE_GATE_RANGE[1]
    out: dict = {"safe_gate": True, "lower_bound": lb} if safe else {}
    if raw is None:
        return out
    return {"g": raw, "use_gate_in_kernel": True, "A_log": gate.A_log.float(), "dt_bias": gate.dt_bias.float(),
            "lower_bound": lb, **out}  # fmt: skip


def fla_core_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``[B, T, H, K]`` in one dtype for fla-core's ``chunk_kda``: v's (the compute dtype, bf16 under
    autocast; an fp32 run stays fp32). ``project`` returns q, k in fp32 (their L2 norm is an fp32 island) and v in
    the compute dtype; fla's kernels multiply q/k tiles with v tiles in ``tl.dot``, which needs one dtype on both
    sides: fp32 q, k with bf16 v does not compile on sm_90 or sm_100 (``bench/kernel_compile.py``: "Both operands
    must be same dtype"). g, beta and the state stay fp32."""
    return q.to(v.dtype), k.to(v.dtype), v


FLA_DEVICES = ("cuda",)  # device types on which ``kda_kernel: fla`` runs fla's core (its Triton kernels)
FLA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # compute dtypes fla's kernels take


def fla_chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, gate: ForgetGate
) -> tuple[Tensor, Tensor]:
    """genoctx's one call of fla-core's ``chunk_kda`` (``fla.ops.kda``, Triton, CUDA): the KDA core as
    ``KimiDeltaAttention`` computes it with ``kda_kernel: fla``, in training (autograd through fla's backward,
    the initial state's gradient included), chunked training and evaluation (a carried state), and under context
    parallelism (each piece's state from ``genoctx.parallel.context``, fp32).

    What fla 0.6 documents and genoctx passes (``tests/kernels/test_kda_fla.py`` runs fla's own argument checks
    on this call, with a stand-in for its kernels):

    - q, k, v ``[B, T, H, K]`` in one dtype (``fla_core_inputs``: v's compute dtype, bf16 under autocast; fla's
      ``tl.dot`` needs one dtype), q and k already L2-normalised (``use_qk_l2norm_in_kernel`` off);
    - g ``[B, T, H, K]`` fp32, our precomputed log decay in natural-log units per token (fla's default:
      ``use_gate_in_kernel`` off), with ``safe_gate`` and ``lower_bound`` where ``fla_gate_kwargs`` says so;
    - beta ``[B, T, H]`` fp32 after the sigmoid (``use_beta_sigmoid_in_kernel`` off); scale ``K^-1/2``;
    - ``initial_state`` ``[B, H, K, V]`` in fp32: fla asserts "initial_state must be in float32", and a carried
      state can reach the layer in another dtype (an FSDP2 ``MixedPrecisionPolicy`` that casts forward inputs
      casts the cache's tensors to bf16), so it is cast here (a no-op for fp32; its gradient flows back through
      the cast);
    - ``output_final_state=True`` (the next chunk's state, fp32); no ``cu_seqlens`` (the B windows of a batch
      are separate sequences of one length, fla's ``N = B``) and no ``cp_context`` (fla's own context
      parallelism takes neither an initial nor a final state; genoctx passes states itself); fla's default chunk
      of 64 tokens (``kda_chunk_size`` and ``kda_block_tokens`` are the torch core's knobs).

    Returns ``(o [B, T, H, V] in q's dtype, state [B, H, K, V] fp32)``.

    Raises:
        GenoctxError: fla-core is not installed, or a compute dtype fla's kernels do not take (fp64).
    """
    try:
        from fla.ops.kda import chunk_kda as fla_core
    except ImportError as err:
        raise GenoctxError("kda_kernel: fla needs fla-core (pip install 'genoctx[gpu]')") from err
    if v.dtype not in FLA_DTYPES:
        raise GenoctxError(f"kda_kernel: fla runs in bf16, fp16 or fp32, not {v.dtype}: use kda_kernel: torch")
    q, k, v = fla_core_inputs(q, k, v)
    h0 = None if initial_state is None else initial_state.float()
    return fla_core(
        q, k, v, g.float(), beta.float(), scale=q.shape[-1] ** -0.5, initial_state=h0, output_final_state=True,
        **fla_gate_kwargs(gate),
    )  # fmt: skip


class GatedRMSNorm(nn.Module):
    """``RMSNorm(o) * weight * sigmoid(gate)`` over the last dim, strictly in fp32 (``Glm5NextTextRMSNormGated``).

    o, gate ``[..., K]`` -> ``[..., K]`` fp32 (fp64 for fp64 input).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: Tensor, gate: Tensor) -> Tensor:
        with torch.autocast(device_type=o.device.type, enabled=False):
            ct = torch.float64 if o.dtype == torch.float64 else torch.float32
            o = o.to(ct)
            o = island("norm.gated", o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)) * self.weight.to(ct)
            return o * torch.sigmoid(gate.to(ct))


class KimiDeltaAttention(nn.Module):
    """The KDA layer of GLM-5.3-Flash (``Glm5NextTextLinearAttention``; Kimi Linear, 2025).

    ``[q|k|v] = silu(conv1d([q_proj x | k_proj x | v_proj x]))`` (one depthwise causal conv of
    ``linear_conv_kernel_dim`` over the ``3 H K`` channels, fp32 weight); q, k L2-normalised per head
    (``l2norm``, eps 1e-6); ``g = forget_gate(x)``; ``beta = sigmoid(b_proj x)``; core ``chunk_kda`` with scale
    ``K^-1/2``; output ``o_proj(RMSNorm(o) * sigmoid(g_b_proj(g_a_proj x)))`` per head (``o_norm``, fp32,
    eps ``rms_norm_eps``). Gate, decay, beta, norms and the core run in fp32 even under bf16 autocast.

    Args:
        cfg: uses ``hidden_size``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``,
            ``linear_lower_bound``, ``kda_chunk_size``, ``kda_block_tokens``, ``rms_norm_eps``,
            ``initializer_range``.
        use_fla: on CUDA, run fla's Triton ``chunk_kda`` instead of ours (recorded in ``stats["path"]``); also on
            with ``cfg.kda_kernel == "fla"``.
        recompute: with grad enabled, save only the core's inputs (and one state per block of
            ``kda_block_tokens``) and rerun ``chunk_kda`` in backward block by block (``chunk_kda(recompute=True)``):
            the core's backward working set is one block's, one extra core forward.
    """

    def __init__(self, cfg: ModelConfig, use_fla: bool = False, recompute: bool = True) -> None:
        super().__init__()
        d, H, Dh = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        self.n_heads, self.head_dim, self.key_dim = H, Dh, H * Dh
        self.conv_size = cfg.linear_conv_kernel_dim
        self.chunk_size = cfg.kda_chunk_size
        self.block_tokens = cfg.kda_block_tokens
        self.init_std = cfg.initializer_range
        self.use_fla = use_fla or cfg.kda_kernel == "fla"
        self.recompute = recompute
        hk = self.key_dim
        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hk, bias=False)
        self.conv1d = nn.Conv1d(3 * hk, 3 * hk, self.conv_size, groups=3 * hk, bias=False, padding=self.conv_size - 1)
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_a_proj = nn.Linear(d, Dh, bias=False)
        self.g_b_proj = nn.Linear(Dh, hk, bias=False)
        self.o_norm = GatedRMSNorm(Dh, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(hk, d, bias=False)
        self.stats: dict = {"path": "chunk"}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linear weights N(0, initializer_range); conv U(+-1/sqrt(kernel)) (torch's default: a from-scratch
        choice; the reference's generic init would give near-zero q, k, v); gate as ``ForgetGate``."""
        for m in (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.g_a_proj, self.g_b_proj, self.o_proj):
            nn.init.normal_(m.weight, std=self.init_std)
        bound = 1.0 / math.sqrt(self.conv_size)
        nn.init.uniform_(self.conv1d.weight, -bound, bound)
        self.forget_gate.reset_parameters(self.init_std)
        self.o_norm.weight.fill_(1.0)

    def project(
        self, x: Tensor, conv_state: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Inputs of the KDA core from the layer input.

        Args:
            x: ``[B, T, hidden_size]``.
            conv_state: ``[B, conv_size - 1, 3 * H * K]`` pre-convolution q|k|v inputs of the previous tokens,
                or None (zeros: start of the sequence).

        Returns:
            ``(q, k, v, g, beta, conv_state)``: q, k, v ``[B, T, H, K]`` (q, k unit norm in fp32; v in x's
            compute dtype), g ``[B, T, H, K]`` fp32 log decay (<= 0), beta ``[B, T, H]`` fp32, and the new conv
            state (x's compute dtype).
        """
        B, T, _ = x.shape
        H, Dh, hk = self.n_heads, self.head_dim, self.key_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, 3 hk]
        if conv_state is None:
            conv_state = qkv.new_zeros(B, self.conv_size - 1, 3 * hk)
        xs = torch.cat([conv_state.to(qkv.dtype), qkv], dim=1)  # [B, conv_size - 1 + T, 3 hk]
        # a copy of the tail: a view would keep the whole [B, T, 3 H K] input alive as long as the cache lives
        new_conv_state = xs[:, xs.shape[1] - (self.conv_size - 1) :].clone()
        w = self.conv1d.weight
        with torch.autocast(device_type=x.device.type, enabled=False):  # the conv is an fp32 island
            wt = torch.promote_types(w.dtype, xs.dtype)
            y = island("kda.conv", F.silu(F.conv1d(xs.transpose(1, 2).to(wt), w.to(wt), groups=3 * hk)))
            y = y.transpose(1, 2).to(qkv.dtype)
        q, k, v = (t.reshape(B, T, H, Dh) for t in y.split(hk, dim=-1))
        g = self.forget_gate(x)
        b = self.b_proj(x)
        with torch.autocast(device_type=x.device.type, enabled=False):  # the sigmoid of the logits, not of bf16
            ct = torch.float64 if x.dtype == torch.float64 else torch.float32
            q, k, beta = l2norm(q.to(ct)), l2norm(k.to(ct)), torch.sigmoid(b.to(ct))
        island("kda.qk", q), island("kda.qk", k), island("kda.beta", beta)
        return q, k, v, g, beta, new_conv_state

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """``o_proj(RMSNorm(o) * sigmoid(g_b_proj(g_a_proj x)))`` (``Glm5NextTextRMSNormGated``): o
        ``[B, T, H, K]`` core output, x ``[B, T, hidden_size]``; returns ``[B, T, hidden_size]``. The norm and
        the gate run in fp32."""
        B, T, _ = x.shape
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, self.n_heads, self.head_dim)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(B, T, self.key_dim).to(x.dtype))

    def forward(self, x: Tensor, cache: KDACache | None = None) -> tuple[Tensor, KDACache]:
        """One chunk of the sequence: ``x`` ``[B, T, hidden_size]`` and the cache of the previous chunk (None at
        the start) -> ``(y [B, T, hidden_size], cache for the next chunk)``. Sets ``self.stats["path"]``.

        Raises:
            GenoctxError: ``use_fla=True`` on CUDA but fla is not installed, or an fp64 run (``fla_chunk_kda``).
        """
        q, k, v, g, beta, conv_state = self.project(x, None if cache is None else cache.conv_state)
        initial_state = None if cache is None else cache.state
        if self.use_fla and x.device.type in FLA_DEVICES:
            o, state = fla_chunk_kda(q, k, v, g, beta, initial_state, self.forget_gate)
            path = "fla"
        else:
            o, state = chunk_kda(
                q, k, v, g, beta, initial_state=initial_state, chunk_size=self.chunk_size,
                block_tokens=self.block_tokens, recompute=self.recompute,
            )  # fmt: skip
            path = "chunk"
        self.stats = {"path": path}
        return self.output(o, x), KDACache(state=state, conv_state=conv_state)
