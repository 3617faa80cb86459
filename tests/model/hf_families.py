"""Tiny random transformers models of the decoder families, saved as checkpoints, for the family tests.

The weights are drawn wider than transformers' initialisation (std 0.2, norm weights 1 ± 0.2, biases
non-zero), so that every parameter matters to the logits and greedy choices are not near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,  # no end-of-sequence id, so generate never treats one specially
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,  # wavelengths on both sides of 32/4 and 32/1: every branch is taken
)
# name -> (transformers class name, config keys): GQA ratios 1, 2, 3 and 4 (4 as MQA), a head_dim that is not
# hidden / heads, tied and untied heads, llama3 RoPE, Qwen2's q/k/v biases, Qwen3's QK-norm and o_proj bias
CASES: dict[str, tuple[str, dict]] = {
    "llama-mha-untied": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4, num_key_value_heads=4, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=False
        ),
    ),
    "llama-gqa3-llama3-rope-biases": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=LLAMA3_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2-gqa2-bias-tied": (
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True),
    ),
    "qwen3-mqa-head_dim-qknorm": (
        "Qwen3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            attention_bias=True,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
    ),
}


# Cases the exact kernels run (a head_dim of 8, 16, 32, 64 or 128) with grouped-query attention and a context
# long enough for the identity tests: Llama with llama3 RoPE, MLP biases and an intermediate size that is not a
# multiple of 8; Qwen2 with q/k/v biases and head_dim 8; Qwen3 with QK-norm, o_proj bias and a head_dim (32)
# that is not hidden / heads.
EXACT_CASES: dict[str, tuple[str, dict]] = {
    "llama-gqa2-llama3-rope-mlp-bias": (
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=100,
            num_attention_heads=4,
            num_key_value_heads=2,
            mlp_bias=True,
            rope_parameters=LLAMA3_ROPE,
            tie_word_embeddings=True,
            max_position_embeddings=256,
        ),
    ),
    "qwen2-gqa3-bias-head_dim8": (
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=256,
        ),
    ),
    "qwen3-gqa2-qknorm-head_dim32": (
        "Qwen3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=256,
        ),
    ),
}


def case(name: str) -> tuple[str, dict]:
    """A case's transformers class name and config keys (TINY's overridden by its own)."""
    class_name, keys = CASES[name] if name in CASES else EXACT_CASES[name]
    return class_name, {**TINY, **keys}


def hf_model(name: str, seed: int = 0):
    """The case's transformers model in float32, eval mode, with wide random weights."""
    import transformers

    class_name, keys = case(name)
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config_class(**keys)).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model


def save(model, directory: Path, **kwargs) -> Path:
    """save_pretrained without its progress bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    model.save_pretrained(directory, **kwargs)
    return directory


def random_decoder(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The case's network as our own CausalLM (no transformers needed), with the same wide random weights'
    distribution as hf_model, in `dtype` on `device`, not yet prepared for inference."""
    from model.models import CausalLM, config_from_hf

    class_name, keys = case(name)
    config = config_from_hf({"architectures": [class_name], **keys})
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model.to(device=device, dtype=dtype).eval()
