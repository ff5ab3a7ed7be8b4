"""RMSNorm as GLM-5.3-Flash computes it (transformers ``Glm5NextTextRMSNorm``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .precision import island


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (Zhang & Sennrich, 2019) as ``Glm5NextTextRMSNorm``: normalised in at least
    fp32, cast back to the input dtype, then scaled by ``weight``.

    x ``[..., D]`` -> ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` ``[..., D]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = island("norm.rms", xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight * y
