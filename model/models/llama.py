"""Llama (Llama 2 and 3, SmolLM2 and other checkpoints of its shape): `attention_bias` puts a bias on all
four attention projections and `mlp_bias` on the three MLP ones; no QK-norm."""

from __future__ import annotations

from typing import Any

from model.models.config import flag, integer

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPE = "llama"


def family_fields(hf: dict[str, Any]) -> dict[str, Any]:
    attention_bias = flag(hf, "attention_bias", False)
    return {
        "head_dim": integer(hf, "head_dim", integer(hf, "hidden_size") // integer(hf, "num_attention_heads")),
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": flag(hf, "mlp_bias", False),
        "qk_norm": False,
    }


def checkpoint_name(name: str) -> str | None:
    # checkpoints written by transformers before 4.31 carry each layer's RoPE frequencies, which are computed
    return None if name.endswith(".rotary_emb.inv_freq") else name
