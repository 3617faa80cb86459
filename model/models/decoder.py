"""The Llama-style decoder that Llama, Qwen2 and Qwen3 share: pre-RMSNorm blocks of grouped-query attention
with RoPE and a SwiGLU MLP, a final RMSNorm, an output head that is the embedding matrix or its own.

Module names are the checkpoints' own (`model.layers.0.self_attn.q_proj.weight`, `model.embed_tokens.weight`,
`lm_head.weight`), so weights load name for name. Every difference between the families is a field of
ModelConfig (biases, QK-norm, head_dim, RoPE, tied head), never a branch on the family.

`forward(input_ids)` runs a (B, T) batch with plain causal attention and no cache: the reference that the
serving path will be compared against, and what the parity tests compare with transformers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from model.models.config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C), cos/sin: (B, T, hd) or (T, hd) -> (B, T, C)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, C)


class DecoderModel(nn.Module):
    """The checkpoint's `model.` prefix: embeddings, layers, final norm (and the computed RoPE tables)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, T); positions: (B, T) or (T,), 0..T-1 if not given. Returns (B, T, C) after the final norm."""
        x = self.embed_tokens(input_ids)  # (B, T, C)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        cos, sin = self.rotary_emb(positions, x.dtype)  # each (B, T, hd) or (T, hd), shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, C)
        return self.norm(x)  # (B, T, C)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # a tied head has no parameter of its own (and no lm_head.weight in the checkpoint)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def output_weight(self) -> torch.Tensor:
        """The head's (vocab, C) matrix: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., C) -> (..., vocab)."""
        return F.linear(hidden, self.output_weight)  # (..., V)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, T) -> logits (B, T, vocab)."""
        return self.compute_logits(self.model(input_ids, positions))  # (B, T, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
