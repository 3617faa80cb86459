"""The engine ends a request at any of the checkpoint's EOS ids (generation_config.json may list several)."""

from __future__ import annotations

import json
import shutil

from model.checkpoint import load_model, load_tokenizer
from model.sampling import SamplingParams
from server.engine import FINISH_EOS, FINISH_LENGTH, Engine
from tests.conftest import TEST_DEVICE


def test_the_engine_stops_on_either_eos_id_a_generation_config_lists(tiny_checkpoint, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    del config["eos_token_id"]  # only generation_config.json's ids, then
    (directory / "config.json").write_text(json.dumps(config))
    model = load_model(directory, device=TEST_DEVICE)
    engine = Engine(model, load_tokenizer(directory), threads=1).start()
    prompt = load_tokenizer(directory).encode("To be, or not")
    try:
        run = engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    finally:
        engine.shutdown()
    tokens = [e.token_id for e in run]
    assert run[-1].finish_reason == FINISH_LENGTH
    later = next(t for t in tokens if t != tokens[0])
    for listed, stops_after in (([tokens[0], later], 1), ([later], tokens.index(later) + 1)):
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
        engine = Engine(model, load_tokenizer(directory), threads=1).start()
        try:
            events = engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0))
        finally:
            engine.shutdown()
        assert [e.token_id for e in events] == tokens[:stops_after], listed
        assert events[-1].finish_reason == FINISH_EOS and events[-1].text == ""
