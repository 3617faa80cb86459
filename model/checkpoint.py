"""Checkpoint directories: config.json + model.safetensors + tokenizer.json (+ README.md model card).

The same layout `transformers`' `save_pretrained` writes for GPT-2, so directories load both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from model.config import ConfigError, GPTConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-small"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # optional: its chat_template serves /v1/chat/completions
# Keys some GPT-2 exports carry that hold no parameters of ours: causal-mask buffers and the tied head.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing a file or does not fit its config."""


def save_checkpoint(model: GPT, tokenizer: Tokenizer | None, directory: str | Path, card: str | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save(directory / CONFIG_FILE)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)
    if card is not None:
        (directory / "README.md").write_text(card)
    return directory


def _require(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} is missing {name}")
    return path


def load_state_dict(directory: Path, config: GPTConfig) -> dict[str, torch.Tensor]:
    raw = load_file(str(_require(directory, WEIGHTS_FILE)))
    state = {}
    for key, tensor in raw.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        state[key if key.startswith("transformer.") else f"transformer.{key}"] = tensor
    return state


def _load_config(directory: Path) -> GPTConfig:
    """The checkpoint's config.json, or CheckpointError with one line (no directory, no file, a bad config)."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    try:
        return GPTConfig.load(_require(directory, CONFIG_FILE))
    except ConfigError as e:
        raise CheckpointError(f"{directory}: {e}") from e


def inspect_checkpoint(directory: str | Path) -> GPTConfig:
    """What loading would find wrong with the files, found in milliseconds without loading them: each file
    is there, config.json is a config this project runs, model.safetensors' header is whole and covers
    the file (a truncated copy fails here). Returns the config; raises CheckpointError with one line."""
    directory = Path(directory)
    config = _load_config(directory)
    weights = _require(directory, WEIGHTS_FILE)
    try:
        with safe_open(str(weights), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} cannot be read: {e}") from e
    _require(directory, TOKENIZER_FILE)
    return config


def load_model(
    directory: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kernels: str = "auto",
    quantization: str | None = None,
) -> GPT:
    """The checkpoint's model on `device`, ready for inference with `kernels` and `quantization`
    (see GPT.prepare_for_inference)."""
    directory = Path(directory or DEFAULT_CHECKPOINT)
    config = _load_config(directory)
    model = GPT(config)
    state = load_state_dict(directory, config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory / WEIGHTS_FILE} does not match config.json: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise CheckpointError(
                f"shape mismatch for {key}: checkpoint has {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[key].shape)}"
            )
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).prepare_for_inference(kernels, quantization)


def load_tokenizer(directory: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer, with the chat template of its tokenizer_config.json when it has one
    (as `transformers` keeps it: a string, or a list of named templates whose 'default' is used)."""
    directory = Path(directory or DEFAULT_CHECKPOINT)
    tokenizer = Tokenizer.from_file(_require(directory, TOKENIZER_FILE))
    config_path = directory / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        try:
            template = json.loads(config_path.read_text()).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{config_path} is not a JSON object: {e}") from e
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        tokenizer.chat_template = template if isinstance(template, str) else None
    return tokenizer
