"""The decoder families beyond GPT-2 (Llama, Qwen2, Qwen3): config.json → ModelConfig (registry) →
CausalLM (decoder) with the checkpoint's weights (loader).

    config = read_config(directory)          # ModelConfig, or CheckpointError naming what is refused
    model = load_model(directory, device="cuda", dtype=torch.bfloat16)
    logits = model(input_ids)                # (B, T) -> (B, T, vocab)
"""

from model.models.config import ModelConfig
from model.models.decoder import CausalLM
from model.models.loader import load_model, read_config
from model.models.registry import SUPPORTED_ARCHITECTURES, architecture_of, config_from_hf, family_for

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "architecture_of",
    "config_from_hf",
    "family_for",
    "load_model",
    "read_config",
]
