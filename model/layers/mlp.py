"""The gated feed-forward block of Llama-style decoders: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn as nn

from model.layers.activation import silu_and_mul


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) -> (..., hidden)."""
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))  # (..., hidden)
