"""Manifold-constrained hyper-connections (mHC, DeepSeek 2025, arXiv:2512.24880).

The residual stream is widened to ``n`` parallel streams ``x_l ∈ R^{n×D}`` per token. Around each sub-layer F:

    x̃       = RMSNorm(flatten(x_l))                                  [B, T, n·D]   (no weight: absorbed in φ)
    H_pre   = sigmoid(α_pre · (x̃ φ_pre) + b_pre)                     [B, T, n]
    H_post  = 2 · sigmoid(α_post · (x̃ φ_post) + b_post)              [B, T, n]
    H_res   = SinkhornKnopp(α_res · mat(x̃ φ_res) + b_res)            [B, T, n, n]  (doubly stochastic)
    x_{l+1} = H_res x_l + H_postᵀ F(H_pre x_l)

Design choices:

- ``pre`` / ``post`` instead of wrapping a callable: the block calls mixers that take and return a cache.
- The three projections are one matrix ``phi`` [n(n+2), n·D] (one read of the wide residual); the RMS
  normalisation is applied after the matmul (``(x φ) · rsqrt(mean x²)``, the same math, cheaper).
- Coefficients are computed in fp32 (fp64 when the input is fp64) with autocast disabled; the stream
  mixing runs in the residual's dtype, also outside autocast (the residual is never silently downcast).
- Init (the paper gives α = 0.01 and leaves b to the implementer): b_pre = −log(n−1) so H_pre = 1/n (the mean
  of the streams, which are copies after ``expand_streams``); b_post = 0 so H_post = 1; b_res puts 0.95 on
  the diagonal of H_res. With equal streams the layer is then a plain residual up to the α-scaled dynamic
  term, whose random φ (std 0.02, as in DeepSeek-V4) breaks the symmetry between streams.
- Sinkhorn-Knopp is recomputed in backward (``torch.utils.checkpoint``): its ``2 x iters`` intermediate
  ``[B, T, n, n]`` tensors would otherwise be the largest activation of the layer.
- ``n_streams == 1`` has no parameters and is exactly ``x + F(x)`` (bit for bit).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

ALPHA_INIT = 0.01  # gate scales α_pre, α_post, α_res (mHC paper)
RES_INIT_DIAG = 0.95  # diagonal of H_res at init (identity-favouring)
PHI_INIT_STD = 0.02


def sinkhorn_knopp(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Project ``exp(logits)`` towards the doubly stochastic matrices (Birkhoff polytope), in log space.

    Alternates row and column normalisation ``iters`` times (Sinkhorn & Knopp 1967; used by mHC,
    arXiv:2512.24880, with ~20 iterations). The last step normalises columns, so columns sum to 1 up to
    rounding; rows reach 1 within 1e-3 after 20 iterations for logits of order 1, more slowly when the
    matrix is close to a permutation (e.g. ~2e-3 for the identity-favouring init of H_res plus noise 0.1).

    Args:
        logits: [..., n, n] float tensor (any float dtype; computed in that dtype).
        iters: number of (row, column) normalisation rounds, >= 1.

    Returns:
        [..., n, n] non-negative matrix, same dtype as ``logits``.

    Raises:
        ValueError: ``iters < 1`` or the last two dimensions are not square.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn_knopp needs square [..., n, n] logits, got {tuple(logits.shape)}")
    log_p = logits
    for _ in range(iters):
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)  # rows sum to 1
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)  # columns sum to 1
    return log_p.exp()


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """Copy the hidden state into each of ``n`` residual streams: [B, T, D] -> [B, T, n, D] (same dtype)."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """Sum the residual streams: [B, T, n, D] -> [B, T, D] (same dtype)."""
    return x.sum(dim=-2)


class HyperConnection(nn.Module):
    """mHC around one sub-layer: ``h, c = hc.pre(x); x = hc.post(x, F(h), c)``.

    Args:
        d_model: D, channels per stream.
        n_streams: n, the number of residual streams (the expansion rate). 1 = plain residual, no parameters.
        sinkhorn_iters: Sinkhorn-Knopp iterations for H_res.
        eps: RMS normalisation epsilon.

    Raises:
        ValueError: ``n_streams < 1``.
    """

    def __init__(self, d_model: int, n_streams: int, sinkhorn_iters: int = 20, eps: float = 1e-6):
        super().__init__()
        if n_streams < 1:
            raise ValueError(f"n_streams must be >= 1, got {n_streams}")
        self.d_model = d_model
        self.n_streams = n = n_streams
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        if n == 1:
            return
        self.phi = nn.Parameter(torch.randn(n * (n + 2), n * d_model) * PHI_INIT_STD)  # [pre | post | res]
        self.alpha_pre = nn.Parameter(torch.tensor(ALPHA_INIT))
        self.alpha_post = nn.Parameter(torch.tensor(ALPHA_INIT))
        self.alpha_res = nn.Parameter(torch.tensor(ALPHA_INIT))
        self.b_pre = nn.Parameter(torch.full((n,), -math.log(n - 1)))
        self.b_post = nn.Parameter(torch.zeros(n))
        off = math.log((1 - RES_INIT_DIAG) / (n - 1) / RES_INIT_DIAG)  # exp-ratio of off-diagonal to diagonal
        self.b_res = nn.Parameter(torch.full((n, n), off).fill_diagonal_(0.0))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_streams={self.n_streams}, sinkhorn_iters={self.sinkhorn_iters}"

    def coefficients(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dynamic mHC mappings of the residual ``x`` [B, T, n, D] (n > 1).

        Returns:
            (H_pre [B, T, n], H_post [B, T, n], H_res [B, T, n, n]) in fp32 (fp64 for fp64 input),
            computed with autocast disabled.
        """
        n = self.n_streams
        cdtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = x.flatten(-2).to(cdtype)  # [B, T, n*D]
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            proj = (xf @ self.phi.to(cdtype).t()) * rstd  # == RMSNorm(xf) @ phiᵀ
            p_pre, p_post, p_res = proj.split([n, n, n * n], dim=-1)
            h_pre = torch.sigmoid(self.alpha_pre.to(cdtype) * p_pre + self.b_pre.to(cdtype))
            h_post = 2.0 * torch.sigmoid(self.alpha_post.to(cdtype) * p_post + self.b_post.to(cdtype))
            res_logits = self.alpha_res.to(cdtype) * p_res.unflatten(-1, (n, n)) + self.b_res.to(cdtype)
            if torch.is_grad_enabled() and res_logits.requires_grad:
                # recomputed in backward: autograd would otherwise keep 2 x iters [B, T, n, n] tensors
                h_res = checkpoint(sinkhorn_knopp, res_logits, self.sinkhorn_iters, use_reentrant=False)
            else:
                h_res = sinkhorn_knopp(res_logits, self.sinkhorn_iters)
        return h_pre, h_post, h_res

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Sub-layer input from the streams.

        Args:
            x: [B, T, n, D] residual streams.

        Returns:
            (h [B, T, D] = Σ_i H_pre[i] x_i in x's dtype, coeffs = (H_post, H_res) fp32, or None when n == 1,
            where h is ``x[:, :, 0]``).
        """
        if self.n_streams == 1:
            return x[..., 0, :], None
        h_pre, h_post, h_res = self.coefficients(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = torch.einsum("...n,...nd->...d", h_pre.to(x.dtype), x)
        return h, (h_post, h_res)

    def post(
        self, x: torch.Tensor, f_out: torch.Tensor, coeffs: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """Next residual streams ``H_res x + H_postᵀ f_out``.

        Args:
            x: [B, T, n, D] residual streams (the input of ``pre``).
            f_out: [B, T, D] sub-layer output.
            coeffs: what ``pre`` returned for this ``x``.

        Returns:
            [B, T, n, D] in the promoted dtype of x and f_out; ``x + f_out[:, :, None]`` when n == 1.
        """
        if self.n_streams == 1:
            return x + f_out.unsqueeze(-2)
        h_post, h_res = coeffs
        dt = torch.promote_types(x.dtype, f_out.dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            mixed = torch.einsum("...ij,...jd->...id", h_res.to(dt), x.to(dt))
            return mixed + h_post.to(dt).unsqueeze(-1) * f_out.to(dt).unsqueeze(-2)
