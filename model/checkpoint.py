"""Checkpoint directories: config.json + model.safetensors (or its shards) + tokenizer.json (+ the optional
tokenizer_config.json, generation_config.json, README.md model card).

The same layout `transformers`' `save_pretrained` writes, so directories load both ways. config.json's
`architectures` picks the network (model.models.registry.architecture_of): GPT2LMHeadModel runs on
model/gpt.py, the Llama, Qwen2 and Qwen3 families on model/models.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from model import models
from model.config import GPT2_ARCHITECTURE, CheckpointError, ConfigError, GPTConfig  # CheckpointError: raised here
from model.description import InferenceModel, ModelDescription
from model.gpt import GPT
from model.models.loader import weight_files
from model.models.registry import architecture_of
from model.tokenizer import Tokenizer, TokenizerError, prompt_special_tokens, read_tokenizer_file

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-small"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # optional: the chat template, BOS and the special tokens' texts
GENERATION_CONFIG_FILE = "generation_config.json"  # optional: its eos_token_id adds to config.json's
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # optional: bos_token and eos_token, as older checkpoints keep them
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # optional: the chat template, as transformers now saves it
# Keys some GPT-2 exports carry that hold no parameters of ours: causal-mask buffers and the tied head.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


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


def load_config(directory: str | Path) -> ModelDescription:
    """The checkpoint's config.json as its architecture's config (GPTConfig, or the families' ModelConfig), or
    CheckpointError with one line naming the file (no directory, no file, an architecture not run here, a bad
    config). A config.json naming neither `architectures` nor `model_type` is GPT-2's."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    path = _require(directory, CONFIG_FILE)
    hf = _read_json_object(path)
    try:
        if hf.get("architectures") or "model_type" in hf:
            architecture = architecture_of(hf)
        else:
            architecture = GPT2_ARCHITECTURE
        if architecture == GPT2_ARCHITECTURE:
            return GPTConfig.load(path)  # its messages name the file
        return models.config_from_hf(hf)
    except ConfigError as e:
        message = str(e)
        raise CheckpointError(message if message.startswith(str(path)) else f"{path}: {message}") from e


def eos_token_ids(directory: Path, config: ModelDescription | None, vocab_size: int) -> tuple[int, ...]:
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


def inspect_checkpoint(directory: str | Path) -> ModelDescription:
    """What loading would find wrong with the files, found in milliseconds without reading the weights: each
    file is there, config.json is a config this project runs, each weights file's header is whole and covers
    the file (a truncated copy fails here), the tokenizer and its optional files load. Returns the config;
    raises CheckpointError with one line naming the file."""
    directory = Path(directory)
    config = load_config(directory)
    for weights in weights_files(directory, config):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{weights} cannot be read: {e}") from e
    load_tokenizer(directory)
    return config


def weights_files(directory: str | Path, config: ModelDescription) -> list[Path]:
    """The files holding the weights: GPT-2's model.safetensors, or the families' one file or shards."""
    directory = Path(directory)
    if isinstance(config, GPTConfig):
        return [_require(directory, WEIGHTS_FILE)]
    return weight_files(directory)


def load_model(
    directory: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kernels: str = "auto",
    quantization: str | None = None,
) -> InferenceModel:
    """The checkpoint's model on `device`, ready for inference with `kernels` and `quantization` (see
    GPT.prepare_for_inference): model.gpt.GPT for GPT-2, model.models.CausalLM for the other families."""
    directory = Path(directory or DEFAULT_CHECKPOINT)
    config = load_config(directory)
    if not isinstance(config, GPTConfig):
        model = models.load_model(directory, device=device, dtype=dtype)
        return model.prepare_for_inference(kernels, quantization)
    return load_gpt(directory, config).to(device=device, dtype=dtype).prepare_for_inference(kernels, quantization)


def load_gpt(directory: Path, config: GPTConfig) -> GPT:
    """GPT-2's weights into model/gpt.py's network, float32 on the CPU; CheckpointError naming what does not fit."""
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
    return model


def load_tokenizer(directory: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer, read as transformers reads it:
    - the ids that end a sequence from config.json and generation_config.json (`eos_token_ids`; where neither
      names one, the id of tokenizer_config.json's eos_token, else `<|endoftext|>`);
    - a prompt's BOS as tokenizer.json's post-processor adds it, or without one as tokenizer_config.json's
      add_bos_token says (`prompt_special_tokens`), never twice;
    - the chat template of chat_template.jinja, else of tokenizer_config.json (a string, or a list of named
      templates whose 'default' is used), with the bos_token and eos_token texts it writes (tokenizer_config.json's,
      else special_tokens_map.json's).
    CheckpointError with one line naming the file that cannot be read."""
    directory = Path(directory or DEFAULT_CHECKPOINT)
    try:
        hf = read_tokenizer_file(_require(directory, TOKENIZER_FILE))
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    config = load_config(directory) if (directory / CONFIG_FILE).is_file() else None
    settings = {}
    for name in (SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE):  # the second's keys win, as in transformers
        if (directory / name).is_file():
            settings.update(_read_json_object(directory / name))
    path = directory / TOKENIZER_CONFIG_FILE
    bos, eos = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
    try:
        add_bos, add_eos = _flag(settings, "add_bos_token", path), _flag(settings, "add_eos_token", path)
        prompt_special_tokens(hf, add_bos, add_eos, bos, eos)
    except TokenizerError as e:
        raise CheckpointError(f"{path}: {e}") from e
    vocab = hf.get_vocab_size(with_added_tokens=True)
    ids = eos_token_ids(directory, config, max(vocab, config.vocab_size) if config else vocab)
    return Tokenizer(
        hf,
        _chat_template(directory, settings),
        ids,
        bos_token=bos,
        eos_token=eos,
        model_vocab_size=config.vocab_size if config else None,
        tokenizer_class=settings.get("tokenizer_class") if isinstance(settings.get("tokenizer_class"), str) else None,
    )


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _flag(settings: dict, key: str, path: Path) -> bool | None:
    value = settings.get(key)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"{path}: {key} must be true or false, got {value!r}")
    return value


def _chat_template(directory: Path, settings: dict) -> str | None:
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} cannot be read: {e}") from e
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
