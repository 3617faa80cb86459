"""Rotary position embedding (RoPE): the default frequencies and Llama 3's `llama3` scaling.

The frequencies and the cos/sin tables are computed in float32 on the CPU with the same operations in the
same order as transformers, then cast to the activations' dtype, so both give the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Rope:
    """A model's RoPE parameters, normalised from config.json's `rope_theta`/`rope_scaling` or `rope_parameters`."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    # llama3 only: frequencies with a wavelength above original_max_position_embeddings / low_freq_factor
    # are divided by factor, those below original / high_freq_factor kept, those between interpolated
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """The rotation frequencies of each pair of a head's dimensions: (head_dim // 2,) float32, on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # (hd/2,)
    inv_freq = 1.0 / (rope.theta**exponents)  # (hd/2,)
    if rope.type == "default":
        return inv_freq
    if rope.type != "llama3":
        raise ValueError(f"unknown RoPE type {rope.type!r}; expected one of {ROPE_TYPES}")
    old_context = rope.original_max_position_embeddings
    long_wavelength = old_context / rope.low_freq_factor  # above it: slowed down by `factor`
    short_wavelength = old_context / rope.high_freq_factor  # below it: unchanged
    wavelength = 2 * math.pi / inv_freq  # (hd/2,)
    slowed = torch.where(wavelength > long_wavelength, inv_freq / rope.factor, inv_freq)  # (hd/2,)
    # between the two wavelengths: a linear blend of the slowed and the unchanged frequency
    blend = (old_context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - blend) * slowed / rope.factor + blend * slowed  # (hd/2,)
    between = ~(wavelength < short_wavelength) * ~(wavelength > long_wavelength)  # (hd/2,)
    return torch.where(between, blended, slowed)  # (hd/2,)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's rotation angles, for apply_rotary."""

    def __init__(self, rope: Rope, head_dim: int) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)  # (hd/2,)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the frequencies to the model's dtype; they stay float32, recomputed
        # on the CPU (exactly as at construction) and moved to wherever the module now lives.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.rope, self.head_dim).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (...) integer positions. Returns cos, sin: (..., head_dim) in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (..., hd/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (..., hd): each frequency rotates dims i and i + hd/2
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., heads, hd) rotated by cos, sin: (..., hd), the same rotation for every head.
    Dims i and i + hd/2 form a pair (the "rotate half" layout of Llama's Hugging Face checkpoints)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., 1, hd)
    x1, x2 = x.chunk(2, dim=-1)  # each (..., heads, hd/2)
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)  # (..., heads, hd)
