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
from model.tokenizer import Tokenizer, TokenizerError, read_tokenizer_file

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-small"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # optional: its chat_template serves /v1/chat/completions
GENERATION_CONFIG_FILE = "generation_config.json"  # optional: its eos_token_id adds to config.json's
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


def _read_json_object(path: Path) -> dict:
    """An optional JSON file of the checkpoint, or CheckpointError with one line naming it."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return d


def load_state_dict(directory: Path, config: GPTConfig) -> dict[str, torch.Tensor]:
    path = _require(directory, WEIGHTS_FILE)
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from e
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
    except ConfigError as e:  # its message names the file
        raise CheckpointError(str(e)) from e


def eos_token_ids(directory: Path, config: GPTConfig | None, vocab_size: int) -> tuple[int, ...]:
    """The ids that end a sequence: config.json's eos_token_id, then those generation_config.json adds when
    one sits beside it (each may name one id or a list: Llama 3's name several). () where neither names
    any: the tokenizer then ends sequences at its `<|endoftext|>`, as GPT-2's checkpoints expect."""
    ids = list(config.eos_token_ids) if config is not None else []
    path = directory / GENERATION_CONFIG_FILE
    if path.is_file():
        eos = _read_json_object(path).get("eos_token_id")
        listed = tuple(eos) if isinstance(eos, list) else eos
        try:
            named = GPTConfig(vocab_size=vocab_size, eos_token_id=listed).eos_token_ids  # the config's own check
        except ConfigError as e:
            raise CheckpointError(f"{path}: {e}") from e
        ids += [i for i in named if i not in ids]
    return tuple(ids)


def inspect_checkpoint(directory: str | Path) -> GPTConfig:
    """What loading would find wrong with the files, found in milliseconds without reading the weights: each
    file is there, config.json is a config this project runs, model.safetensors' header is whole and covers
    the file (a truncated copy fails here), the tokenizer and its optional files load. Returns the config;
    raises CheckpointError with one line naming the file."""
    directory = Path(directory)
    config = _load_config(directory)
    weights = _require(directory, WEIGHTS_FILE)
    try:
        with safe_open(str(weights), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} cannot be read: {e}") from e
    load_tokenizer(directory)
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
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            # a NaN or inf weight makes every answer NaN: refused here rather than served
            raise CheckpointError(f"{directory / WEIGHTS_FILE}: tensor {key} holds NaN or infinite values")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).prepare_for_inference(kernels, quantization)


def load_tokenizer(directory: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer: its EOS ids from config.json and generation_config.json (`eos_token_ids`;
    a directory without config.json: `<|endoftext|>`), and the chat template of its tokenizer_config.json
    when it has one (as `transformers` keeps it: a string, or a list of named templates whose 'default' is
    used). CheckpointError with one line naming the file that cannot be read."""
    directory = Path(directory or DEFAULT_CHECKPOINT)
    try:
        hf = read_tokenizer_file(_require(directory, TOKENIZER_FILE))
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    config = _load_config(directory) if (directory / CONFIG_FILE).is_file() else None
    ids = eos_token_ids(directory, config, config.vocab_size if config else hf.get_vocab_size(with_added_tokens=True))
    template = None
    config_path = directory / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        template = _read_json_object(config_path).get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return Tokenizer(hf, template if isinstance(template, str) else None, ids)
