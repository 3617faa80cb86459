"""`python -m server` on a decoder family's checkpoint: it starts, serves the context --max-model-len asks for
(never more than the model's), caps a context the default KV cache cannot hold, and refuses at start what it
cannot run, naming it."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

pytest.importorskip("transformers")

from model.checkpoint import load_config  # noqa: E402
from server.engine.context_length import served_config  # noqa: E402
from tests.model.family_checkpoints import family_checkpoint  # noqa: E402
from tests.server.conftest import ServerProcess  # noqa: E402
from tests.server.test_startup_failures import one_error_line, run_server  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_a_llama_checkpoint_starts_and_serves_the_context_max_model_len_asks_for(llama):
    server = ServerProcess(llama, "--max-model-len", "64").wait_healthy()
    try:
        info = httpx.get(server.url + "/info", timeout=10).json()
        assert info["max_total_tokens"] == 64
        r = httpx.post(server.url + "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 70}})
        assert r.status_code == 422 and "context of 64 tokens" in r.json()["error"], r.text
        r = httpx.post(server.url + "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_max_model_len_past_the_models_context_exits_2_naming_it(llama):
    result = run_server(llama, "--max-model-len", "300")
    assert result.returncode == 2, result.stderr
    one_error_line(result, "--max-model-len 300 is longer than the model's context of 256 tokens")


def test_a_kv_cache_too_small_for_the_context_names_both_flags(llama):
    result = run_server(llama, "--kv-cache-memory", "64KiB")
    assert result.returncode == 2, result.stderr
    one_error_line(result, "fewer than one 256-token sequence needs", "raise --kv-cache-memory", "--max-model-len")


def test_a_sliding_window_model_exits_1_naming_what_is_not_run(llama, tmp_path):
    """A Qwen2 config.json with sliding-window layers is refused at start, not served with full attention."""
    directory = tmp_path / "qwen2-sliding"
    directory.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((llama / name).read_bytes())
    config = json.loads((llama / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=64)
    config["max_window_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    result = run_server(directory)
    assert result.returncode == 1, result.stderr
    one_error_line(result, "config.json", "use_sliding_window=true", "sliding-window attention, which is not supported")


def test_the_default_kv_cache_caps_a_context_it_cannot_hold(llama, monkeypatch, caplog):
    """Llama 3.2 names 131,072 tokens: without --max-model-len or --kv-cache-memory, the context served is what
    a quarter of the free memory holds, in whole blocks, and a warning says so."""
    config = load_config(llama)
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # float32 keys and values
    monkeypatch.setattr("server.engine.context_length.available_memory", lambda device: 4 * 100 * per_token)
    f32 = dict(block_size=16, cache_dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        served = served_config(config, max_model_len=None, kv_cache_sized=False, **f32)
    assert served.context_length == 96  # 100 tokens' worth, in blocks of 16
    assert "serving a context of 96 tokens, not the model's 256" in caplog.text
    assert served_config(config, max_model_len=None, kv_cache_sized=True, **f32).context_length == 256
    assert served_config(config, max_model_len=200, kv_cache_sized=False, **f32).context_length == 200


def test_sharded_weights_pass_the_start_up_checks(llama, tmp_path):
    """A checkpoint whose weights are shards listed by model.safetensors.index.json (no model.safetensors):
    the files are checked and counted as the weights' size, as one file is."""
    import transformers

    from server.cli import check_args, kv_cache_memory_problem, parse_args

    directory = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    model.save_pretrained(directory, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((llama / name).read_bytes())
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (directory / "model.safetensors").exists()
    assert check_args(parse_args(["--checkpoint", str(directory), "--kv-cache-memory", "1MiB"])) is None
    weights = sum(f.stat().st_size for f in shards)
    problem = kv_cache_memory_problem(2**40, directory, torch.device("cpu"))
    assert problem is not None and f"({weights / 2**20:.3g} MiB)" in problem
