"""The normalised config of the Llama-style decoder families: one frozen dataclass read from Hugging Face
config.json keys, whatever the family and whichever of transformers' spellings the file uses.

What differs between families (biases, QK-norm, the head_dim default) is chosen by the family's module
(model/models/llama.py, qwen2.py, qwen3.py) and lands in a field here; the network reads only fields.
Everything this code does not run (sliding windows, experts, RoPE scalings other than `llama3`, partial
rotary, activations other than SiLU) is refused with a ConfigError that names the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from model.config import ConfigError
from model.layers.rotary import ROPE_TYPES, Rope

# Keys that make a config a mixture of experts; any of them set (non-zero) is refused.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
SUPPORTED_ACTIVATIONS = ("silu",)
# transformers' default when config.json names no rope_theta (RotaryEmbeddingConfigMixin.default_theta)
DEFAULT_ROPE_THETA = 10000.0


class Family(Protocol):
    """What a family module (model/models/llama.py, ...) provides."""

    ARCHITECTURES: tuple[str, ...]  # config.json `architectures` entries it runs
    MODEL_TYPE: str  # config.json `model_type`

    def family_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig's family-chosen fields: head_dim, qkv_bias, o_bias, mlp_bias, qk_norm."""
        ...

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into, or None for a tensor that holds no parameter."""
        ...


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the `architectures` entry that chose the family, e.g. "Qwen3ForCausalLM"
    model_type: str  # "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the SwiGLU MLP's inner width
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads, a divisor of num_attention_heads (GQA; 1 = MQA)
    head_dim: int  # per head; need not be hidden_size / num_attention_heads (Qwen3)
    rms_norm_eps: float
    max_position_embeddings: int  # the context length
    rope: Rope
    qkv_bias: bool  # biases on q_proj, k_proj, v_proj
    o_bias: bool  # a bias on o_proj
    mlp_bias: bool  # biases on gate_proj, up_proj, down_proj
    qk_norm: bool  # RMSNorm over head_dim on each q and k head before RoPE (q_norm, k_norm)
    tie_word_embeddings: bool  # the output head is the embedding matrix (no lm_head.weight)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos_token_id, an int or a list
    torch_dtype: str | None  # the dtype config.json says the weights were saved in; information only

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for name in (*sizes, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    # ---- model.description.ModelDescription ---------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def with_context_length(self, context_length: int) -> ModelConfig:
        """max_position_embeddings lowered: the model as served (RoPE reads its own original context)."""
        if isinstance(context_length, bool) or not isinstance(context_length, int):
            raise ConfigError(f"a context length must be an integer, got {context_length!r}")
        if not 0 < context_length <= self.max_position_embeddings:
            raise ConfigError(
                f"a context of {context_length} tokens: the model serves at most its max_position_embeddings "
                f"({self.max_position_embeddings})"
            )
        return self.replace(max_position_embeddings=context_length)

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], architecture: str, family: Family) -> ModelConfig:
        """config.json's keys as `family` reads them (model.models.registry.config_from_hf picks the family)."""
        refuse_experts(hf)
        act = hf.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act {act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        heads = integer(hf, "num_attention_heads")
        return cls(
            architecture=architecture,
            model_type=family.MODEL_TYPE,
            vocab_size=integer(hf, "vocab_size"),
            hidden_size=integer(hf, "hidden_size"),
            intermediate_size=integer(hf, "intermediate_size"),
            num_hidden_layers=integer(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=integer(hf, "num_key_value_heads", heads),
            rms_norm_eps=number(hf, "rms_norm_eps", 1e-6),
            max_position_embeddings=integer(hf, "max_position_embeddings"),
            rope=rope_from_hf(hf),
            tie_word_embeddings=flag(hf, "tie_word_embeddings", False),
            bos_token_id=None if hf.get("bos_token_id") is None else integer(hf, "bos_token_id"),
            eos_token_ids=token_ids(hf, "eos_token_id"),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            **family.family_fields(hf),
        )


def integer(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key)
    if value is None:  # absent or null
        value = default
    if value is None:
        raise ConfigError(f"config.json lacks {key}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value


def number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def flag(hf: dict[str, Any], key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def token_ids(hf: dict[str, Any], key: str) -> tuple[int, ...]:
    value = hf.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(f"{key} must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def refuse_experts(hf: dict[str, Any]) -> None:
    for key in MOE_KEYS:
        if hf.get(key):
            raise ConfigError(
                f"{key}={hf[key]!r}: mixture-of-experts models are not supported, only dense decoders "
                f"(architectures {hf.get('architectures')})"
            )


def refuse_sliding_window(hf: dict[str, Any]) -> None:
    """Qwen2/Qwen3's keys, read as transformers reads them: `sliding_window` counts only with
    `use_sliding_window` true, and then applies to the layers `layer_types` marks "sliding_attention"
    (without layer_types, the layers from `max_window_layers` on). Any such layer is refused."""
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise ConfigError(f"layer_types {unknown} are not supported; supported: full_attention")
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return
    layers = integer(hf, "num_hidden_layers")
    if types is None:
        first = integer(hf, "max_window_layers", 28)
        sliding = [i for i in range(layers) if i >= first]
    else:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise ConfigError(
            f"use_sliding_window=true with sliding_window={hf['sliding_window']} makes layers "
            f"{sliding[:8]}{'...' if len(sliding) > 8 else ''} sliding-window attention, which is not "
            f"supported; only full attention is"
        )


def rope_from_hf(hf: dict[str, Any]) -> Rope:
    """Either spelling: transformers 5's `rope_parameters` {rope_type, rope_theta, ...}, or the older top-level
    `rope_theta` with `rope_scaling` {type or rope_type, ...}; `rope_scaling` wins where both are set, as
    transformers reads them."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{field} must be a JSON object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{field} with one entry per layer type is not supported; only one RoPE for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{field}: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={partial} is not supported: only RoPE over the whole head (1.0)")
    theta = number(params, "rope_theta", number(hf, "rope_theta", DEFAULT_ROPE_THETA))
    if rope_type == "default":
        return Rope(theta=theta)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ConfigError(f"{field}: rope_type 'llama3' needs {missing}")
    return Rope(
        theta=theta,
        type=rope_type,
        factor=number(params, "factor", 1.0),
        low_freq_factor=number(params, "low_freq_factor", 1.0),
        high_freq_factor=number(params, "high_freq_factor", 4.0),
        original_max_position_embeddings=integer(
            params, "original_max_position_embeddings", integer(hf, "max_position_embeddings")
        ),
    )
