"""`python -m server`: flags (server/cli.py) and refusal of an incomplete checkpoint."""

from __future__ import annotations

import pytest

from model.checkpoint import DEFAULT_CHECKPOINT
from server.__main__ import main
from server.cli import check_args, parse_args, parse_cluster_args
from server.engine.config import EngineConfig


def test_defaults_follow_the_brief():
    args = parse_args([])
    assert (args.checkpoint, args.host, args.port, args.device, args.dtype) == (
        DEFAULT_CHECKPOINT,
        "127.0.0.1",
        8000,
        "auto",
        "float32",
    )


def test_engine_flags_default_to_the_engine_config():
    """The server and an Engine built in code run with the same settings (the flag once said 256)."""
    args, config = parse_args([]), EngineConfig()
    assert (
        args.max_num_seqs,
        args.max_waiting,
        args.max_num_batched_tokens,
        args.kv_cache_memory,
        args.block_size,
        args.prefix_caching,
    ) == (
        config.max_num_seqs,
        config.max_waiting,
        config.max_num_batched_tokens,
        config.kv_cache_memory,
        config.block_size,
        config.enable_prefix_caching,
    )


def test_quantization_flag_reaches_the_engine_config():
    assert parse_args([]).quantization is None and EngineConfig().quantization is None
    assert parse_args(["--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int4"])


def test_flags_parse():
    args = parse_args(["--checkpoint", "x", "--max-num-seqs", "4", "--max-waiting", "9", "--port", "0"])
    assert (str(args.checkpoint), args.max_num_seqs, args.max_waiting, args.port) == ("x", 4, 9, 0)


def test_an_incomplete_checkpoint_exits_2_with_a_message(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["--checkpoint", str(tmp_path)]) == 2
    assert "missing model.safetensors, tokenizer.json" in capsys.readouterr().err


def test_security_and_limit_flags_parse(monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    args = parse_args([])
    assert (
        args.api_key,
        args.cors_origin,
        args.max_body_bytes,
        args.max_stop_sequences,
        args.request_timeout,
        args.shutdown_grace,
    ) == (None, [], 2_000_000, 4, None, 30.0)
    args = parse_args(
        [
            "--api-key",
            "k",
            "--cors-origin",
            "http://a",
            "--cors-origin",
            "http://b",
            "--max-body-bytes",
            "10",
            "--max-input-tokens",
            "5",
            "--max-new-tokens",
            "6",
            "--max-stop-sequences",
            "2",
            "--max-stop-length",
            "9",
            "--request-timeout",
            "1.5",
            "--shutdown-grace",
            "0",
        ]
    )
    assert (
        args.api_key,
        args.cors_origin,
        args.max_body_bytes,
        args.max_input_tokens,
        args.max_new_tokens,
        args.max_stop_sequences,
        args.max_stop_length,
        args.request_timeout,
        args.shutdown_grace,
    ) == ("k", ["http://a", "http://b"], 10, 5, 6, 2, 9, 1.5, 0.0)


def test_the_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env"


def test_a_limit_of_zero_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--max-new-tokens", "0"])
    assert "must be > 0" in capsys.readouterr().err


def test_the_step_time_target_flag_reaches_the_engine_config():
    assert parse_args([]).target_step_ms is EngineConfig().target_step_ms is None
    assert parse_args(["--target-step-ms", "40"]).target_step_ms == 40.0
    with pytest.raises(SystemExit):
        parse_args(["--target-step-ms", "0"])


def test_the_ngram_history_flag_reaches_the_engine_config_and_zero_turns_it_off():
    from server.cli import engine_config_from

    assert engine_config_from(parse_args([])).ngram_history == EngineConfig().ngram_history > 0
    assert engine_config_from(parse_args(["--ngram-history", "0"])).ngram_history == 0
    assert engine_config_from(parse_args(["--ngram-history", "24"])).ngram_history == 24
    with pytest.raises(SystemExit):
        parse_args(["--ngram-history", "-1"])


def test_a_device_torch_does_not_know_exits_2_with_a_message(capsys):
    """`--device gpu` is a usage error (one line, exit 2), not torch's traceback."""
    assert main(["--device", "gpu"]) == 2
    assert "unknown device 'gpu'" in capsys.readouterr().err


def test_log_level_trace_starts_as_the_help_says(tmp_path):
    """'trace' (uvicorn's level below debug) is one of --log-level's choices; naming it to `logging` before
    uvicorn has configured its loggers raised ValueError. Run as a process: pytest's own logging handlers
    would hide it in this one. The cluster's command configures logging before it checks the checkpoint."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "server.cluster", "--checkpoint", str(tmp_path / "missing"), "--log-level", "trace"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "not a complete checkpoint" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("parse", [parse_args, parse_cluster_args], ids=["server", "cluster"])
def test_both_commands_take_ports_0_to_65535_only(parse, capsys):
    """A larger --port was bound modulo 65536 (99999 became 34463) or to a random port (65536)."""
    assert [parse(["--port", p]).port for p in ("0", "8000", "65535")] == [0, 8000, 65535]
    for port in ("65536", "99999", "-1", "http"):
        with pytest.raises(SystemExit):
            parse(["--port", port])
        assert "argument --port: " in capsys.readouterr().err


def test_a_kv_cache_size_that_is_not_a_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "inf"])  # int(inf) raised OverflowError through argparse
    assert "not a size in bytes: 'inf'" in capsys.readouterr().err


def test_a_kv_cache_above_the_free_memory_is_refused_before_anything_loads(tiny_checkpoint, monkeypatch, capsys):
    """--kv-cache-memory 64GB on a 23 GiB machine stayed up unhealthy, zeroing memory towards the OOM killer."""
    monkeypatch.setattr("model.kv_cache.available_memory", lambda device="cpu": 23 * 2**30)
    assert main(["--checkpoint", str(tiny_checkpoint), "--kv-cache-memory", "64GB"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory asks for a KV cache of 59.6 GiB" in err and "the 23 GiB of memory available" in err
    assert check_args(parse_args(["--checkpoint", str(tiny_checkpoint), "--kv-cache-memory", "16GB"])) is None
    # the replicas of a local Ray share this machine: two of 16 GB do not fit
    two = parse_cluster_args(["--checkpoint", str(tiny_checkpoint), "--kv-cache-memory", "16GB"])
    kind, message = check_args(two, engines_here=2)
    assert kind == "usage" and "for each of 2 replicas" in message


def test_the_cluster_command_does_not_import_the_server_command():
    """Both commands take their flags from server/cli.py; the cluster's imported `python -m server`'s
    module for them, and server/cluster/app.py imported both."""
    import subprocess
    import sys

    code = "import sys, server.cluster.__main__; print('server.__main__' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
