"""RMSNorm: x / sqrt(mean(x²) + eps) * weight, the statistics in float32 whatever the input's dtype."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim). The normalised x is cast back to x's dtype before the weight multiplies it,
        in that order, as transformers does (the order changes the rounding in half precision)."""
        x32 = x.float()  # (..., dim)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        return self.weight * x32.to(x.dtype)  # (..., dim)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
