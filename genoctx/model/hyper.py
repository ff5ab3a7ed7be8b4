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
- Sinkhorn is recomputed in backward (``torch.utils.checkpoint``): its ``2 x iters`` intermediate
  ``[B, T, n, n]`` tensors would otherwise be the largest activation of the layer.
- Init as the reference's ``_init_weights``: ``fn ~ N(0, 0.02)``, ``base = 0``, ``scale = 1``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .precision import island


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of a positive ``[..., n, n]`` matrix, as ``Glm5NextTextHyperConnection``.

    Divides by the column sums (``+ eps``), then ``iters - 1`` rounds of rows then columns. Same dtype as
    ``comb``; after 20 iterations rows and columns sum to 1 within ~1e-3 for softmax inputs.

    Raises:
        ValueError: ``iters < 1`` or non-square trailing dimensions.
    """
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}")
    if comb.shape[-1] != comb.shape[-2]:
        raise ValueError(f"sinkhorn needs square [..., n, n] input, got {tuple(comb.shape)}")
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _comb(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return sinkhorn(torch.softmax(logits, dim=-1) + eps, iters, eps)


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
        cdt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = x.flatten(-2).to(cdt)
            xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.norm_eps)
            a = F.linear(xf, self.fn.to(cdt))
            pre_w, post_w, comb_w = a.split([n, n, n * n], dim=-1)
            base, scale = self.base.to(cdt), self.scale.to(cdt)
            pre_b, post_b, comb_b = base.split([n, n, n * n])
            pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
            post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
            logits = (comb_w * scale[2] + comb_b).unflatten(-1, (n, n))
            if torch.is_grad_enabled() and logits.requires_grad:
                comb = checkpoint(_comb, logits, self.sinkhorn_iters, self.hc_eps, use_reentrant=False)
            else:
                comb = _comb(logits, self.sinkhorn_iters, self.hc_eps)
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
