"""Model configuration: a dataclass that reads and writes Hugging Face GPT-2's `config.json` keys (and provides
model.description.ModelDescription), the check that a prompt fits the model (its context and vocabulary), and
the errors of a config and a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

GPT2_ARCHITECTURE = "GPT2LMHeadModel"
SHAPE_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")  # required: they shape every tensor
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """A config.json that this project cannot run."""


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing a file or does not fit its config."""


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
    eos_token_id: int | tuple[int, ...] | None = 0  # one id or several (Llama 3 names three); None: not named
    bos_token_id: int = 0

    def __post_init__(self) -> None:
        """Every value the model divides by, indexes with or sizes a tensor from, checked here, so that a bad
        config.json is a ConfigError naming its key, never a ZeroDivisionError or a shape error later."""
        for name in SHAPE_KEYS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        eps = self.layer_norm_epsilon
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < math.inf:
            raise ConfigError(f"layer_norm_epsilon must be a positive number, got {eps!r}")
        ids = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        if self.eos_token_id is not None and not all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
            raise ConfigError(
                f"eos_token_id must be a token id in [0, {self.vocab_size}) or a list of them, "
                f"got {self.eos_token_id!r}"
            )

    # ---- model.description.ModelDescription ---------------------------------------------------------

    @property
    def architecture(self) -> str:
        return GPT2_ARCHITECTURE

    @property
    def context_length(self) -> int:
        return self.n_positions

    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def num_heads(self) -> int:
        return self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_head  # multi-head attention: a key and a value per query head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def with_context_length(self, context_length: int) -> GPTConfig:
        """n_positions lowered: the model as served (the weights keep their position rows; a GPT is built from
        the checkpoint's own config)."""
        if not _is_int(context_length) or not 0 < context_length <= self.n_positions:
            raise ConfigError(
                f"a context of {context_length!r} tokens: GPT-2 serves at most its n_positions "
                f"({self.n_positions}, its learned positions)"
            )
        return self.replace(n_positions=context_length)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence, as config.json names them: none, one or several."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

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
        check_architecture(d)
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
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else 0,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GPTConfig:
        """The config at `path`; ConfigError with one line naming the file (and the key, where one is wrong)."""
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        except OSError as e:
            raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path} is not a JSON object")
        try:
            check_architecture(d)  # before the keys: another family's config lacks GPT-2's
            missing = [k for k in SHAPE_KEYS if k not in d]
            if missing:
                raise ConfigError(f"lacks required keys {missing}")
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
        except TypeError as e:  # a value of the wrong type where no check names it
            raise ConfigError(f"{path} has a value of the wrong type: {e}") from e


def check_architecture(d: dict) -> None:
    """ConfigError naming the architecture a config.json describes, unless it is GPT-2 (the other families'
    configs are read by model.models; model.checkpoint picks the reader by architecture)."""
    archs = d.get("architectures") or [GPT2_ARCHITECTURE]
    model_type = d.get("model_type", "gpt2")
    if model_type != "gpt2" or GPT2_ARCHITECTURE not in archs:
        found = ", ".join(map(str, archs)) if isinstance(archs, list) else repr(archs)
        raise ConfigError(f"architecture {found} (model_type {model_type}) is not GPT-2 ({GPT2_ARCHITECTURE})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Named presets: the shapes this project trains.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=4),
    "small": GPTConfig(vocab_size=8192, n_positions=512, n_embd=256, n_layer=4, n_head=8),
    "baby": GPTConfig(vocab_size=8192, n_positions=512, n_embd=384, n_layer=6, n_head=6),
}
