"""Model configuration: a dataclass that reads and writes Hugging Face GPT-2's `config.json` keys, and the
check that a prompt fits the model (its context and vocabulary)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel",)
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """A config.json that this project cannot run."""


class PromptError(ValueError):
    """A prompt the model cannot run."""


class ContextLengthError(PromptError):
    """A prompt that, with the tokens asked for, does not fit the model's context (OpenAI's
    context_length_exceeded, which clients catch to trim a conversation)."""


def check_prompt(prompt_ids: list[int], max_new_tokens: int, context: int, vocab_size: int) -> None:
    """What the model can run: a non-empty prompt of ids in its vocabulary that, with the tokens to
    generate, fits the context. The one check of a prompt; the engine and generate() call it."""
    if not prompt_ids:
        raise PromptError("the prompt is empty: at least one token is needed")
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        raise PromptError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt_ids) >= context:
        raise ContextLengthError(
            f"the prompt has {len(prompt_ids)} tokens; the context holds {context}, "
            f"so it must be shorter than that (the model's maximum context length is "
            f"{context} tokens)"
        )
    if len(prompt_ids) + max_new_tokens > context:
        raise ContextLengthError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the context of {context} tokens (the model's maximum context length)"
        )


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    n_positions: int = 512  # context length (learned position embeddings)
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 8
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.0  # used only in training
    eos_token_id: int = 0
    bos_token_id: int = 0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict:
        """GPT-2's config.json keys, so `transformers` loads our checkpoints unchanged."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": None,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "attn_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "resid_pdrop": self.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> GPTConfig:
        archs = d.get("architectures") or ["GPT2LMHeadModel"]
        if d.get("model_type", "gpt2") != "gpt2" or not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ConfigError(
                f"unknown architecture: model_type={d.get('model_type')!r}, architectures={archs}; "
                f"this project runs only {SUPPORTED_ARCHITECTURES} (model_type 'gpt2')"
            )
        act = d.get("activation_function", "gelu_new")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"unsupported activation_function {act!r}; expected one of {SUPPORTED_ACTIVATIONS}")
        n_inner = d.get("n_inner")
        if n_inner not in (None, 4 * d["n_embd"]):
            raise ConfigError(f"n_inner={n_inner} is not supported (only 4 * n_embd)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if d.get(flag):
                raise ConfigError(f"{flag}=true is not supported")
        if d.get("tie_word_embeddings", True) is False:
            raise ConfigError("untied word embeddings are not supported (tie_word_embeddings=false)")
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"],
            n_positions=d["n_positions"],
            n_embd=d["n_embd"],
            n_layer=d["n_layer"],
            n_head=d["n_head"],
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            dropout=0.0,
            eos_token_id=eos if isinstance(eos, int) else 0,
            bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else 0,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GPTConfig:
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path} is not a JSON object")
        missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if k not in d]
        if missing:
            raise ConfigError(f"{path} lacks required keys {missing}")
        try:
            return cls.from_hf_dict(d)
        except TypeError as e:  # a value of the wrong type, e.g. "n_embd": "256"
            raise ConfigError(f"{path} has a value of the wrong type: {e}") from e


# Named presets: the shapes this project trains.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=4),
    "small": GPTConfig(vocab_size=8192, n_positions=512, n_embd=256, n_layer=4, n_head=8),
    "baby": GPTConfig(vocab_size=8192, n_positions=512, n_embd=384, n_layer=6, n_head=6),
}
