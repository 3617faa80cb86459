"""Qwen2 and Qwen2.5: biases on q_proj, k_proj and v_proj always (whatever `attention_bias` says, as in
transformers' Qwen2 classes), none on o_proj or the MLP; no QK-norm. Sliding-window layers are refused."""

from __future__ import annotations

from typing import Any

from model.models.config import integer, refuse_sliding_window

ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPE = "qwen2"


def family_fields(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_sliding_window(hf)
    return {
        "head_dim": integer(hf, "head_dim", integer(hf, "hidden_size") // integer(hf, "num_attention_heads")),
        "qkv_bias": True,
        "o_bias": False,
        "mlp_bias": False,
        "qk_norm": False,
    }


def checkpoint_name(name: str) -> str | None:
    return name
