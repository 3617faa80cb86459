"""Bad prompts and bad checkpoints fail with clear, specific errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, inspect_checkpoint, load_model, load_tokenizer
from model.config import PromptError
from model.generate import generate
from model.sampling import SamplingError, SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


def run(model, tokenizer, prompt, params=GREEDY):
    return list(generate(model, tokenizer, prompt, params))


def test_prompt_longer_than_context_is_refused(tiny_model, tiny_tokenizer):
    too_long = [1] * tiny_model.config.n_positions
    with pytest.raises(PromptError, match="context holds 128"):
        run(tiny_model, tiny_tokenizer, too_long)


def test_prompt_plus_new_tokens_beyond_context_is_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(PromptError, match=r"max_new_tokens \(100\) exceeds the context of 128"):
        run(tiny_model, tiny_tokenizer, [1] * 40, SamplingParams(max_new_tokens=100, temperature=0))


def test_empty_prompt_is_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(PromptError, match="empty"):
        run(tiny_model, tiny_tokenizer, "")


def test_token_ids_out_of_range_are_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(PromptError, match=r"out of range \[0, \d+\): \[-1, 99999\]"):
        run(tiny_model, tiny_tokenizer, [3, -1, 99999])


def test_model_forward_refuses_sequences_past_the_context(tiny_model):
    with pytest.raises(ValueError, match="exceeds the context"):
        tiny_model(torch.zeros(1, tiny_model.config.n_positions + 1, dtype=torch.long))


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("repetition_penalty", 0.0),
        ("max_new_tokens", 0),
        ("temperature", float("nan")),
        ("stop", ("",)),
    ],
)
def test_out_of_range_sampling_parameters_are_refused(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


@pytest.fixture
def broken_copy(tmp_path, tiny_checkpoint):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, target)
    return target


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_checkpoint_file_is_named(broken_copy, missing):
    (broken_copy / missing).unlink()
    with pytest.raises(CheckpointError, match=f"missing {missing}"):
        load_model(broken_copy)


def test_missing_tokenizer_is_named(broken_copy):
    (broken_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="missing tokenizer.json"):
        load_tokenizer(broken_copy)


def test_shape_mismatch_names_the_tensor(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["n_embd"] = 64
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"shape mismatch for transformer\.\S+: checkpoint has \(\d+"):
        load_model(broken_copy)


MIXTRAL_CONFIG = {  # the keys of a Mixtral checkpoint's config.json that matter here: none of GPT-2's
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "vocab_size": 400,
    "num_local_experts": 8,
}
UNSUPPORTED_MIXTRAL = (
    "unsupported architecture MixtralForCausalLM (model_type mixtral); "
    "supported: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
)


def test_unknown_architecture_is_refused_listing_the_supported_ones(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["model_type"], config["architectures"] = "mixtral", ["MixtralForCausalLM"]
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(UNSUPPORTED_MIXTRAL)):
        load_model(broken_copy)


def test_another_familys_config_names_its_architecture_not_the_gpt2_keys_it_lacks(broken_copy):
    """A Mixtral config.json lacks n_positions and the other GPT-2 keys: what is wrong is the architecture."""
    (broken_copy / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    with pytest.raises(CheckpointError, match=re.escape(UNSUPPORTED_MIXTRAL)) as raised:
        inspect_checkpoint(broken_copy)
    assert "config.json" in str(raised.value) and "lacks required keys" not in str(raised.value)


def test_a_family_config_lacking_a_key_is_named_with_the_key(broken_copy):
    """A Llama config.json is read by the families' reader: what it lacks is named, not GPT-2's keys."""
    llama = {k: v for k, v in MIXTRAL_CONFIG.items() if k != "num_local_experts"}
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (broken_copy / "config.json").write_text(json.dumps(llama))
    with pytest.raises(CheckpointError, match=re.escape("config.json: config.json lacks intermediate_size")):
        inspect_checkpoint(broken_copy)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("n_head", 0, "n_head must be a positive integer, got 0"),
        ("n_layer", 0, "n_layer must be a positive integer, got 0"),
        ("vocab_size", -1, "vocab_size must be a positive integer, got -1"),
        ("n_positions", 0, "n_positions must be a positive integer, got 0"),
        ("n_embd", 0, "n_embd must be a positive integer, got 0"),
        ("n_head", "4", "n_head must be a positive integer, got '4'"),
        ("n_head", 3, "n_embd (32) must be divisible by n_head (3)"),
        ("layer_norm_epsilon", 0, "layer_norm_epsilon must be a positive number, got 0"),
        ("eos_token_id", 100000, "eos_token_id must be a token id in [0, "),
    ],
)
def test_a_config_value_that_cannot_shape_the_model_is_named_with_its_key(broken_copy, key, value, message):
    """Refused when config.json is read, before anything divides by it (n_head 0 was a ZeroDivisionError)."""
    config = json.loads((broken_copy / "config.json").read_text())
    config[key] = value
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(message)) as raised:
        inspect_checkpoint(broken_copy)
    assert str(raised.value).startswith(str(broken_copy / "config.json")), raised.value


def test_non_finite_weights_are_refused_naming_the_tensor(broken_copy):
    """A NaN weight turns every answer into NaN: the checkpoint does not load."""
    weights = load_file(str(broken_copy / "model.safetensors"))
    weights["transformer.h.1.mlp.c_fc.weight"][0, 3] = float("nan")
    save_file(weights, str(broken_copy / "model.safetensors"))
    named = re.escape("model.safetensors: tensor transformer.h.1.mlp.c_fc.weight holds NaN")
    with pytest.raises(CheckpointError, match=named):
        load_model(broken_copy)


@pytest.mark.parametrize("damage", ["not_json", "unreadable"])
def test_a_tokenizer_file_that_cannot_be_read_is_named(broken_copy, damage):
    """The tokenizers library's own message ('expected value at line 1', 'Input/output error (os error 5)')
    names no file. Unreadable: a link to a file whose read fails even for root (reading /proc/self/mem at
    offset 0)."""
    path = broken_copy / "tokenizer.json"
    path.unlink()
    if damage == "not_json":
        path.write_text("not json")
    else:
        path.symlink_to("/proc/self/mem")
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path))} cannot be read as a tokenizer: .+"):
        load_tokenizer(broken_copy)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
