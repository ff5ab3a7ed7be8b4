"""Manifold-constrained hyper-connections (mHC, DeepSeek 2025, arXiv:2512.24880) as GLM-5.3-Flash runs them.

The residual stream is ``n = hc_mult`` streams ``x ∈ R^{n×D}`` per token. Around each sub-layer F
(transformers ``Glm5NextTextHyperConnection.forward`` and ``Glm5NextTextDecoderLayer.forward``):

    x̃     = x_flat * rsqrt(mean(x_flat²) + rms_norm_eps)                 [B, T, n·D]  (no weight)
    a     = x̃ fnᵀ                                                         [B, T, (2+n)·n]
    pre   = sigmoid(scale[0] · a_pre  + base_pre) + hc_eps                [B, T, n]
    post  = 2 · sigmoid(scale[1] · a_post + base_post)                    [B, T, n]
    comb  = Sinkhorn(softmax_row(scale[2] · a_comb + base_comb) + hc_eps)  [B, T, n, n]
    out_i = post_i · F(Σ_j pre_j x_j) + Σ_j comb[j, i] x_j                (out = post ⊗ F + combᵀ x)

Sinkhorn (the reference's order): divide by column sums, then ``hc_sinkhorn_iters - 1`` times rows then
columns, each sum ``+ hc_eps``. The model starts with the embedding copied into the ``n`` streams
(``expand_streams``) and ends with their mean (``Glm5NextTextHyperHead``, ``reduce_streams``).

Design choices:

- ``pre`` / ``post`` instead of wrapping a callable: the block calls mixers that take and return a cache.
- Coefficients are computed in fp32 (fp64 for an fp64 residual) with autocast disabled; ``base`` and
  ``scale`` are fp32 islands (kept fp32 when the model is cast to bf16, as the reference's
  ``_keep_in_fp32_modules_strict``). The collapse is summed in fp32 and returned in the residual's dtype.
- Sinkhorn is one autograd Function (``comb_map``, ``_Sinkhorn``) with a hand-written backward: it saves the
  ``2 iters - 1`` denominators (``n`` each per token) and rebuilds the iterates from the output in reverse, instead
  of autograd's graph of ``3 (2 iters - 1)`` ops (or its recomputation under a checkpoint). ``sinkhorn_reference``
  is the slow autograd form, tested equal forward and backward.
- Aten ops per call (fp32 or fp64, grad on; bf16 autocast the same; ``n >= 2``): ``pre`` + ``post`` forward
  ``4 iters + 49``, backward ``6 iters + 88``; with grad off ``4 iters + 45``. Independent of the tokens.
- Init as the reference's ``_init_weights``: ``fn ~ N(0, 0.02)``, ``base = 0``, ``scale = 1``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .precision import island


def _check(comb: torch.Tensor, iters: int) -> None:
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}")
    if comb.shape[-1] != comb.shape[-2]:
        raise ValueError(f"sinkhorn needs square [..., n, n] input, got {tuple(comb.shape)}")


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The slow reference of :func:`sinkhorn`: ``Glm5NextTextHyperConnection``'s loop in autograd's ops.

    Divides by the column sums (``+ eps``), then ``iters - 1`` rounds of rows then columns: ``2 iters - 1``
    normalisations of 3 aten ops each (sum, add, div), and autograd's graph of them (each division saving its input
    and denominator). Same dtype as ``comb``.

    Raises:
        ValueError: ``iters < 1`` or non-square trailing dimensions.
    """
    _check(comb, iters)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _comb_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``sinkhorn_reference(softmax(logits) + eps)``: the comb map as the reference computes it."""
    return sinkhorn_reference(torch.softmax(logits, dim=-1) + eps, iters, eps)


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp with a hand-written backward (the math of :func:`sinkhorn_reference`, fewer ops).

    Layout: the ``M`` matrices of ``[..., n, n]`` are worked on as one ``[n, n, M]`` tensor (one copy in, one out),
    so that every sum over a row or column reduces over an outer dimension and every division broadcasts along
    the contiguous ``M``: vectorised elementwise passes, where the ``[..., n, n]`` layout's inner dimension of ``n``
    (4 at mHC) runs a CPU's loops 4 elements at a time (7-8x slower there; a GPU is indifferent).

    Forward (no graph): the matrices sit in the top-left ``n x n`` of an ``(n+1) x (n+1) x M`` buffer whose last row
    and column hold ``eps``, so a column (row) sum over the buffer's first ``n`` columns (rows) is the sum ``+ eps``
    in one op: 2 ops per normalisation. It saves each denominator ``d_k`` ([1, n, M] or [n, 1, M]) and the output.

    Backward: for ``y_k = y_{k-1} / d_k`` with ``d_k = sum(y_{k-1}) + eps`` autograd's gradient is
    ``g_{k-1} = (g_k - sum(g_k y_k)) / d_k``. Carried as ``h_k = g_k y_k`` it is ``h_{k-1} = h_k - sum(h_k) y_k``
    (the ``d_k`` cancel: one ``addcmul_``), and ``y_{k-1} = y_k d_k`` rebuilds the iterates from the output in
    reverse (relative error about one rounding per step, each entry scaled on its own, so tiny entries stay exact
    in relative terms). At the end ``g_0 = h_0 / y_0`` with the saved input, then (``softmax``) the softmax's
    backward in one op. 3 ops per normalisation, no recomputation.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, iters: int, eps: float, softmax: bool) -> torch.Tensor:
        n = x.shape[-1]
        p = torch.softmax(x, dim=-1) if softmax else x  # (in x's layout: the reference's rounding of exp)
        p = p.reshape(-1, n, n).permute(1, 2, 0).contiguous()  # [i, j, M]: every op below keeps this layout
        buf = F.pad(p + eps if softmax else p, (0, 0, 0, 1, 0, 1), value=eps)  # (no out= view: dynamo refuses it)
        rows, cols = buf[:n], buf[:, :n]  # sums over these include the eps column / row
        y = rows[:, :n]
        dens = []
        for k in range(2 * iters - 1):
            d = cols.sum(dim=0, keepdim=True) if k % 2 == 0 else rows.sum(dim=1, keepdim=True)
            dens.append(d)
            if k < 2 * iters - 2:
                y.div_(d)
            else:
                y = y / d  # the last step out of place: a contiguous [n, n, M], the buffer freed
        ctx.eps, ctx.softmax = eps, softmax
        out = y.permute(2, 0, 1).reshape(x.shape).contiguous()
        ctx.save_for_backward(p, out, *dens)  # the output in x's layout: the one copy that mHC's post keeps too
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        p, out, *dens = ctx.saved_tensors
        n = p.shape[0]
        y = out.reshape(-1, n, n).permute(1, 2, 0).contiguous()  # [n, n, M] as forward's
        h = g.reshape(-1, n, n).permute(1, 2, 0).contiguous().mul_(y)
        for k in range(len(dens) - 1, -1, -1):
            h.addcmul_(h.sum(dim=0 if k % 2 == 0 else 1, keepdim=True), y, value=-1)
            if k > 0:
                # the first step out of place: ``y`` may be the saved output itself (n = 1: no copy was needed)
                y = y * dens[k] if k == len(dens) - 1 else y.mul_(dens[k])
        if not ctx.softmax:
            g0 = h.div_(p)
        else:
            g0 = torch._softmax_backward_data(h.div_(p + ctx.eps), p, 1, p.dtype)
        return g0.permute(2, 0, 1).reshape(out.shape), None, None, None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of a positive ``[..., n, n]`` matrix, as ``Glm5NextTextHyperConnection``.

    Divides by the column sums (``+ eps``), then ``iters - 1`` rounds of rows then columns. Same dtype as
    ``comb``; after 20 iterations rows and columns sum to 1 within ~1e-3 for softmax inputs. The values and
    gradients of :func:`sinkhorn_reference` (to rounding) in ``4 iters + 9`` aten ops forward and ``6 iters + 9``
    backward (``_Sinkhorn``); it keeps ``(2 iters - 1) n`` denominators per matrix for backward besides the input
    and the output (no recomputation).

    Raises:
        ValueError: ``iters < 1`` or non-square trailing dimensions.
    """
    _check(comb, iters)
    return _Sinkhorn.apply(comb, iters, eps, False)


def comb_map(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """mHC's residual mixing ``sinkhorn(softmax(logits, -1) + eps, iters, eps)`` of ``[..., n, n]`` logits.

    Same dtype as ``logits`` (fp32 or fp64). One autograd Function (``_Sinkhorn``): ``4 iters + 11`` aten ops forward
    (``4 iters + 10`` with grad off), ``6 iters + 11`` backward, none recomputed. Saved for backward per matrix: the
    softmax ``n^2``, the output ``n^2`` (which ``HyperConnection.post`` keeps anyway) and ``(2 iters - 1) n``
    denominators, in ``logits``' dtype (at ``n = 4``, 20 iterations, fp32: 64 + 624 bytes per token besides the
    output; the reference's checkpoint kept the ``n^2`` logits: ``genoctx.plan.sizes._hc``). Equal to
    :func:`_comb_reference` to rounding, forward and backward.

    Raises:
        ValueError: ``iters < 1`` or non-square trailing dimensions.
    """
    _check(logits, iters)
    return _Sinkhorn.apply(logits, iters, eps, True)


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """Copy the embedding into each of ``n`` residual streams: [B, T, D] -> [B, T, n, D] (same dtype)."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """Final collapse, the mean over streams (``Glm5NextTextHyperHead``): [B, T, n, D] -> [B, T, D]."""
    return x.mean(dim=-2)


class HyperConnection(nn.Module):
    """mHC around one sub-layer: ``h, c = hc.pre(x); x = hc.post(x, F(h), c)``.

    Parameters (names of ``Glm5NextTextHyperConnection``): ``fn`` [(2+n)·n, n·D], ``base`` [(2+n)·n],
    ``scale`` [3].

    Args:
        hidden_size: D.
        n_streams: n (``hc_mult``).
        sinkhorn_iters: ``hc_sinkhorn_iters``.
        hc_eps: ``hc_eps`` (pre offset, comb offset, Sinkhorn denominators).
        norm_eps: ``rms_norm_eps`` of the unweighted RMSNorm of the flattened streams.
        init_std: std of ``fn``.
    """

    def __init__(
        self,
        hidden_size: int,
        n_streams: int,
        sinkhorn_iters: int = 20,
        hc_eps: float = 1e-6,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
    ):
        super().__init__()
        n = n_streams
        self.hidden_size, self.n_streams = hidden_size, n
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.randn((2 + n) * n, n * hidden_size) * init_std)
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, n_streams={self.n_streams}, sinkhorn_iters={self.sinkhorn_iters}"

    def coefficients(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dynamic mappings of the residual ``x`` [B, T, n, D].

        Returns:
            (pre [B, T, n], post [B, T, n], comb [B, T, n, n]) in fp32 (fp64 for fp64 input), autocast off.
        """
        n = self.n_streams
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # promote_types would be an aten op
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = x.flatten(-2).to(cdt)
            xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.norm_eps)
            a = F.linear(xf, self.fn.to(cdt))
            pre_w, post_w, comb_w = a.split([n, n, n * n], dim=-1)
            pre_b, post_b, comb_b = self.base.to(cdt).split([n, n, n * n])
            pre_s, post_s, comb_s = self.scale.to(cdt).unbind()  # one op (and one in backward), not 3 selects
            pre = torch.sigmoid(torch.addcmul(pre_b, pre_w, pre_s)) + self.hc_eps  # a * scale + base in one op
            post = 2 * torch.sigmoid(torch.addcmul(post_b, post_w, post_s))
            logits = torch.addcmul(comb_b, comb_w, comb_s).unflatten(-1, (n, n))
            comb = comb_map(logits, self.sinkhorn_iters, self.hc_eps)
        for c in (pre, post, comb):
            island("mhc.coeffs", c)
        return pre, post, comb

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Sub-layer input from the streams.

        Args:
            x: [B, T, n, D] residual streams.

        Returns:
            (h [B, T, D] = Σ_j pre_j x_j, summed in fp32 and returned in x's dtype; (post, comb) fp32).
        """
        pre, post, comb = self.coefficients(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
        return h, (post, comb)

    def post(self, x: torch.Tensor, f_out: torch.Tensor, coeffs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Next residual streams ``post ⊗ f_out + combᵀ x`` (``Glm5NextTextDecoderLayer.forward``).

        Args:
            x: [B, T, n, D] residual streams (the input of ``pre``).
            f_out: [B, T, D] sub-layer output.
            coeffs: what ``pre`` returned for this ``x``.

        Returns:
            [B, T, n, D] in x's dtype (the coefficients are cast to it first, as the reference does).
        """
        post, comb = coeffs
        dt = x.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            mixed = torch.matmul(comb.to(dt).transpose(-1, -2), x)
            return post.to(dt).unsqueeze(-1) * f_out.to(dt).unsqueeze(-2) + mixed
