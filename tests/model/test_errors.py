"""Bad prompts and bad checkpoints fail with clear, specific errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from model.checkpoint import CheckpointError, load_model, load_tokenizer
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


def test_unknown_architecture_is_refused(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["model_type"], config["architectures"] = "llama", ["LlamaForCausalLM"]
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unknown architecture.*llama"):
        load_model(broken_copy)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
