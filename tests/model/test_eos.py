"""Which tokens end a sequence: the EOS ids of config.json and generation_config.json (one id or a list, as
Llama 3's checkpoints name several), any of which stops generation; `<|endoftext|>` where neither names one."""

from __future__ import annotations

import json
import shutil

import pytest

from model.checkpoint import DEFAULT_CHECKPOINT, CheckpointError, load_model, load_tokenizer
from model.generate import generate
from model.sampling import SamplingParams
from model.text import FINISH_EOS, FINISH_LENGTH
from model.tokenizer import EOS_TOKEN
from tests.conftest import TEST_DEVICE

NEW_TOKENS = 12


def greedy(model, tokenizer, ignore_eos: bool = False) -> tuple[list[int], str | None]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=ignore_eos)
    steps = list(generate(model, tokenizer, "To be, or not", params))
    return [s.token_id for s in steps], steps[-1].finish_reason


def test_the_default_checkpoint_ends_at_endoftext_as_its_config_names_it():
    config = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())
    tokenizer = load_tokenizer(DEFAULT_CHECKPOINT)
    assert tokenizer.eos_token_ids == (config["eos_token_id"],) == (tokenizer.hf.token_to_id(EOS_TOKEN),)


@pytest.fixture
def without_eos(tmp_path, tiny_checkpoint):
    """A copy of the tiny checkpoint whose config.json names no EOS id."""
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    del config["eos_token_id"]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_without_an_eos_id_named_endoftext_ends_a_sequence(without_eos):
    tokenizer = load_tokenizer(without_eos)
    assert tokenizer.eos_token_ids == (tokenizer.hf.token_to_id(EOS_TOKEN),)


def test_a_generation_config_listing_two_eos_ids_stops_on_either(without_eos):
    model = load_model(without_eos, device=TEST_DEVICE)
    tokens, _ = greedy(model, load_tokenizer(without_eos), ignore_eos=True)
    first, later = tokens[0], next(t for t in tokens if t != tokens[0])
    unused = next(i for i in range(model.config.vocab_size) if i not in tokens)
    for listed, stops_after in (([unused, first], 1), ([later, unused], tokens.index(later) + 1)):
        (without_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
        tokenizer = load_tokenizer(without_eos)
        assert tokenizer.eos_token_ids == tuple(listed)
        got, reason = greedy(model, tokenizer)
        assert (got, reason) == (tokens[:stops_after], FINISH_EOS), f"EOS ids {listed}: {got} ({reason})"
        assert greedy(model, tokenizer, ignore_eos=True) == (tokens, FINISH_LENGTH)


def test_the_generation_configs_ids_add_to_the_configs(tiny_checkpoint, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, directory)
    named = json.loads((directory / "config.json").read_text())["eos_token_id"]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, named, 9]}))
    assert load_tokenizer(directory).eos_token_ids == (named, 7, 9)


@pytest.mark.parametrize(
    "content, message",
    [("{", "generation_config.json is not valid JSON"), ('{"eos_token_id": [3, "x"]}', "eos_token_id must be")],
)
def test_a_bad_generation_config_is_named(without_eos, content, message):
    (without_eos / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(without_eos)
