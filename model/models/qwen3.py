"""Qwen3 (dense): RMSNorm over each q and k head (q_norm, k_norm) before RoPE, a head_dim of its own (128
when config.json names none, as transformers' Qwen3Config defaults), `attention_bias` on all four attention
projections. Sliding-window layers are refused."""

from __future__ import annotations

from typing import Any

from model.models.config import flag, integer, refuse_sliding_window

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPE = "qwen3"


def family_fields(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_sliding_window(hf)
    attention_bias = flag(hf, "attention_bias", False)
    return {
        "head_dim": integer(hf, "head_dim", 128),
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": False,
        "qk_norm": True,
    }


def checkpoint_name(name: str) -> str | None:
    return name
