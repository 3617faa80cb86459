"""Layers shared by the decoder families (Llama, Qwen2, Qwen3): one op per file, each computed as
transformers computes it, so a model built from them matches transformers' logits."""

from model.layers.activation import silu_and_mul
from model.layers.attention import Attention, causal_attention
from model.layers.mlp import GatedMLP
from model.layers.rms_norm import RMSNorm
from model.layers.rotary import Rope, RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "Attention",
    "GatedMLP",
    "RMSNorm",
    "Rope",
    "RotaryEmbedding",
    "apply_rotary",
    "causal_attention",
    "rope_inv_freq",
    "silu_and_mul",
]
