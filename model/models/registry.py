"""Which code runs a checkpoint: config.json's `architectures` entry (checked against its `model_type`)
names a family module, and the family module reads the config's family-specific keys."""

from __future__ import annotations

from typing import Any

from model.config import GPT2_ARCHITECTURE, ConfigError
from model.models import llama, qwen2, qwen3
from model.models.config import Family, ModelConfig

# GPT2LMHeadModel is run by model.gpt (model.checkpoint.load_model picks it), not by the families here
FAMILIES: dict[str, Family] = {arch: family for family in (llama, qwen2, qwen3) for arch in family.ARCHITECTURES}
SUPPORTED_ARCHITECTURES = (GPT2_ARCHITECTURE, *FAMILIES)
_MODEL_TYPES = {"gpt2": GPT2_ARCHITECTURE} | {family.MODEL_TYPE: arch for arch, family in FAMILIES.items()}


def architecture_of(hf: dict[str, Any]) -> str:
    """The supported architecture config.json names (its `model_type` alone when it lists none); ConfigError
    listing the supported ones otherwise, or when `model_type` says another model than `architectures` (transformers
    builds the model its model_type names, so the two must agree)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if not isinstance(archs, list):
        raise ConfigError(f"architectures must be a list, got {archs!r}")
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not archs and model_type in _MODEL_TYPES:
        known = [_MODEL_TYPES[model_type]]
    if not known:
        found = ", ".join(map(str, archs)) or "(none listed)"
        raise ConfigError(
            f"unsupported architecture {found} (model_type {model_type}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = known[0]
    expected = "gpt2" if arch == GPT2_ARCHITECTURE else FAMILIES[arch].MODEL_TYPE
    if model_type is not None and model_type != expected:
        raise ConfigError(
            f"model_type {model_type!r} does not match architectures {archs} ({arch} is model_type {expected!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def family_for(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise ConfigError(
            f"architecture {architecture!r} is not one of the decoder families; supported: {', '.join(FAMILIES)}"
            + (" (GPT2LMHeadModel is run by model.gpt)" if architecture == GPT2_ARCHITECTURE else "")
        )
    return FAMILIES[architecture]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The normalised config of a Llama/Qwen2/Qwen3 config.json's keys; ConfigError naming what is refused."""
    if not isinstance(hf, dict):
        raise ConfigError("config.json is not a JSON object")
    architecture = architecture_of(hf)
    return ModelConfig.from_hf(hf, architecture, family_for(architecture))
