"""Grouped-query causal self-attention with the Llama-family options: q/k/v and output biases, per-head
RMSNorm on q and k (Qwen3's QK-norm) before RoPE, a head_dim that need not be hidden / heads.

num_key_value_heads spans the family: equal to num_heads is multi-head attention, 1 is multi-query, and
in between each key/value head serves num_heads / num_key_value_heads query heads.

`project` returns keys already rotated (RoPE applied at their own positions): what a KV cache stores, so
a cached key never needs its position again. `forward` is the whole (B, T) causal attention with no cache.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers.rms_norm import RMSNorm
from model.layers.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        """qk_norm_eps: when given, RMSNorm over each head's head_dim on q and k (weights q_norm, k_norm)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (..., C) tokens, cos/sin: (..., hd) at their positions. Returns q: (..., nh, hd) and the
        rotated k, and v: (..., nkv, hd), token-major as a cache is written."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))  # (..., nh, hd)
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))  # (..., nkv, hd)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))  # (..., nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over hd
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C), cos/sin: (B, T, hd) or (T, hd). Each token attends to itself and those before it."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)  # (B, T, nh, hd), (B, T, nkv, hd) x2
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # (B, T, C)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (B, nh, T, hd), k, v: (B, nkv, T, hd) with nh a multiple of nkv: query head h reads key/value
    head h // (nh / nkv). Softmax(q k^T / sqrt(hd)) v over the positions up to each query's: (B, nh, T, hd)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
