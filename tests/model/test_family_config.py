"""config.json of the Llama, Qwen2 and Qwen3 families normalised into ModelConfig, and each feature this code
does not run refused with a ConfigError that names it."""

from __future__ import annotations

import pytest

from model.config import ConfigError
from model.layers import Rope
from model.models import SUPPORTED_ARCHITECTURES, config_from_hf
from model.models.presets import PRESETS


def test_published_shapes_normalise_to_their_specs():
    smol, llama = config_from_hf(PRESETS["smollm2-135m"]), config_from_hf(PRESETS["llama-3.2-1b"])
    qwen2, qwen3 = config_from_hf(PRESETS["qwen2.5-0.5b"]), config_from_hf(PRESETS["qwen3-0.6b"])
    shapes = {
        name: (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        for name, c in (("smol", smol), ("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3))
    }
    assert shapes == {
        "smol": (30, 576, 9, 3, 64),
        "llama": (16, 2048, 32, 8, 64),
        "qwen2": (24, 896, 14, 2, 64),
        "qwen3": (28, 1024, 16, 8, 128),
    }
    assert [c.intermediate_size for c in (smol, llama, qwen2, qwen3)] == [1536, 8192, 4864, 3072]
    assert [c.rms_norm_eps for c in (smol, llama, qwen2, qwen3)] == [1e-5, 1e-5, 1e-6, 1e-6]
    assert all(c.tie_word_embeddings for c in (smol, llama, qwen2, qwen3))
    assert smol.rope == Rope(theta=1e5) and qwen2.rope == qwen3.rope == Rope(theta=1e6)
    assert llama.rope == Rope(5e5, "llama3", 32.0, 1.0, 4.0, 8192)
    assert llama.eos_token_ids == (128001, 128008, 128009) and smol.eos_token_ids == (0,)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    assert not any(c.qkv_bias or c.o_bias or c.mlp_bias or c.qk_norm for c in (smol, llama))


def test_rope_parameters_and_rope_scaling_spellings_agree():
    """transformers 5's rope_parameters, the older rope_theta + rope_scaling, and rope_scaling's older "type"."""
    old = PRESETS["llama-3.2-1b"]
    scaling = dict(old["rope_scaling"])
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = dict(scaling, rope_theta=old["rope_theta"])
    legacy = dict(old, rope_scaling={k: v for k, v in scaling.items() if k != "rope_type"} | {"type": "llama3"})
    assert config_from_hf(new) == config_from_hf(old) == config_from_hf(legacy)
    assert config_from_hf(old).rope.type == "llama3"


def test_defaults_follow_transformers():
    """No num_key_value_heads: one per query head; Qwen3 without head_dim: 128, as Qwen3Config defaults;
    Llama without it: hidden / heads; no rope_theta: 10000."""
    llama = {k: v for k, v in PRESETS["smollm2-135m"].items() if k not in ("num_key_value_heads", "rope_theta")}
    assert config_from_hf(llama).num_key_value_heads == 9 and config_from_hf(llama).rope.theta == 10000.0
    qwen3 = {k: v for k, v in PRESETS["qwen3-0.6b"].items() if k != "head_dim"}
    assert config_from_hf(dict(qwen3, hidden_size=512)).head_dim == 128
    assert config_from_hf(dict(PRESETS["llama-3.2-1b"], head_dim=None)).head_dim == 64


def test_qwen2_sliding_window_configured_but_off_is_accepted():
    config = config_from_hf(dict(PRESETS["qwen2.5-0.5b"], sliding_window=32768, max_window_layers=21))
    assert config.num_hidden_layers == 24


def refused(base: str, **changes) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_hf(dict(PRESETS[base], **changes))
    return str(info.value)


def test_unknown_architecture_is_refused_listing_the_supported_ones():
    message = refused("smollm2-135m", architectures=["MistralForCausalLM"], model_type="mistral")
    assert "MistralForCausalLM" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_model_type_disagreeing_with_architectures_is_refused():
    message = refused("qwen3-0.6b", model_type="qwen2")
    assert "model_type 'qwen2'" in message and "Qwen3ForCausalLM" in message


def test_gpt2_is_pointed_to_its_own_model():
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is run by model.gpt"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8})


def test_qwen2_sliding_window_is_refused():
    message = refused("qwen2.5-0.5b", use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    assert "use_sliding_window" in message and "sliding_window=4096" in message and "[20, 21, 22, 23]" in message


def test_qwen3_sliding_layer_types_are_refused():
    types = ["full_attention", "sliding_attention"] * 14
    message = refused("qwen3-0.6b", use_sliding_window=True, sliding_window=4096, layer_types=types)
    assert "sliding_window=4096" in message and "[1, 3, 5" in message


def test_unknown_layer_types_are_refused():
    assert "layer_types ['chunked_attention']" in refused("qwen3-0.6b", layer_types=["chunked_attention"] * 28)


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok"])
def test_mixture_of_experts_keys_are_refused(key):
    message = refused("qwen3-0.6b", **{key: 8})
    assert f"{key}=8" in message and "mixture-of-experts" in message


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic", "longrope"])
def test_unsupported_rope_types_are_refused(field, rope_type):
    message = refused("smollm2-135m", **{field: {"rope_type": rope_type, "factor": 4.0}})
    assert field in message and repr(rope_type) in message and "default, llama3" in message


def test_partial_rotary_factor_is_refused():
    assert "partial_rotary_factor=0.5" in refused("smollm2-135m", partial_rotary_factor=0.5)


def test_rope_per_layer_type_is_refused():
    per_layer = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    assert "one entry per layer type" in refused("qwen3-0.6b", rope_parameters=per_layer)


def test_llama3_rope_without_its_factors_is_refused():
    assert "needs ['low_freq_factor', 'high_freq_factor']" in refused(
        "llama-3.2-1b", rope_scaling={"rope_type": "llama3", "factor": 32.0}
    )


def test_other_activations_are_refused():
    message = refused("qwen2.5-0.5b", hidden_act="gelu")
    assert "hidden_act 'gelu'" in message and "silu" in message


def test_key_value_heads_that_do_not_divide_the_heads_are_refused():
    assert "num_key_value_heads (4) must divide num_attention_heads (9)" in refused(
        "smollm2-135m", num_key_value_heads=4
    )


@pytest.mark.parametrize(
    ("key", "value"), [("hidden_size", "576"), ("tie_word_embeddings", "yes"), ("eos_token_id", [1.5])]
)
def test_values_of_the_wrong_type_are_refused_naming_the_key(key, value):
    assert key in refused("smollm2-135m", **{key: value})


@pytest.mark.parametrize("shape", sorted(PRESETS))
def test_presets_read_by_transformers_normalise_alike(shape):
    """Each preset as transformers' config class reads and writes it back (transformers 5's spelling,
    its defaults filled in) gives the same ModelConfig as the preset itself."""
    transformers = pytest.importorskip("transformers")
    keys = {k: v for k, v in PRESETS[shape].items() if k not in ("architectures", "model_type", "torch_dtype")}
    written = transformers.AutoConfig.for_model(PRESETS[shape]["model_type"], **keys).to_dict()
    written["architectures"] = PRESETS[shape]["architectures"]
    assert config_from_hf(written).replace(torch_dtype=None) == config_from_hf(PRESETS[shape]).replace(torch_dtype=None)
