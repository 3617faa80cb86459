"""Bad process input ends `python -m server` at once, so a supervisor sees it: a bad flag value exits 2
before anything loads; a checkpoint that cannot be loaded, or an address that cannot be listened on, exits 1
with one line saying why and no traceback (unless --log-level debug) or abort, never leaving an unhealthy
process holding its port."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from unittest.mock import MagicMock

import pytest
from safetensors.torch import load_file, save_file

from tests.server.conftest import server_command

ROOT = Path(__file__).parents[2]
GUARD_S = 120  # only a guard against a hang: a failing start takes seconds


def run_server(checkpoint: Path, *flags: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = server_command(checkpoint, port, *flags)
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the server was still up after {GUARD_S} s: {e.stderr}")


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    return directory


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "error" in line.lower()]


@pytest.mark.parametrize(
    "flags,messages",
    [
        (["--dtype", "f32"], ["unknown dtype 'f32'"]),
        (["--kv-cache-memory", "1"], ["the KV cache holds 0 blocks", "raise --kv-cache-memory"]),
        (["--dtype", "bfloat16", "--kv-cache-dtype", "float32"], ["a float32 KV cache under a bfloat16 model"]),
    ],
)
def test_a_bad_flag_value_exits_2_before_anything_loads(tiny_checkpoint, flags, messages):
    result = run_server(tiny_checkpoint, *flags)
    assert result.returncode == 2, result.stderr
    assert all(m in result.stderr for m in messages), result.stderr
    assert "usage: python -m server" in result.stderr
    assert "Traceback" not in result.stderr and "Uvicorn running" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "damage,message",
    [
        ("corrupt_config", "config.json is not valid JSON"),
        ("truncated_weights", "model.safetensors cannot be read"),
    ],
)
def test_an_unloadable_checkpoint_exits_1_with_one_line_and_no_traceback(tiny_checkpoint, tmp_path, damage, message):
    directory = copy_of(tiny_checkpoint, tmp_path)
    if damage == "corrupt_config":
        config = directory / "config.json"
        config.write_text(config.read_text()[:40])
    else:
        weights = directory / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = run_server(directory)
    assert result.returncode == 1, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_checkpoint_that_fails_while_loading_ends_the_process_with_its_reason(tiny_checkpoint, tmp_path):
    """Files that pass the quick checks but do not load (weights shaped for another config): the loading
    thread's failure stops the server, exit 1, one line; with --log-level debug, the traceback too."""
    directory = copy_of(tiny_checkpoint, tmp_path)
    config = directory / "config.json"
    config.write_text(config.read_text().replace('"n_layer": 2', '"n_layer": 3'))
    result = run_server(directory, "--log-level", "warning")
    assert result.returncode == 1, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and "loading the engine failed: CheckpointError" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    debug = run_server(directory, "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr, debug.stderr


def one_error_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The one line saying what is wrong, which must name each needle; no traceback, no C++ abort."""
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr, result.stderr
    lines = [line for line in error_lines(result) if not line.startswith((" ", "usage:"))]  # not argparse's usage
    assert len(lines) == 1 and all(n in lines[0] for n in needles), result.stderr
    return lines[0]


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_port_out_of_range_exits_2_naming_the_flag(tiny_checkpoint, port):
    """99999 was served on 34463 (modulo 65536) while the log said 99999; 65536 took a random port; -1
    aborted the process."""
    result = run_server(tiny_checkpoint, "--port", port)
    assert result.returncode == 2, result.stderr
    one_error_line(result, "argument --port", f"must be a port in 0..65535 (0: any free port), got {port}")
    assert "Uvicorn running" not in result.stderr


def test_a_port_in_use_exits_1_with_one_line_and_no_abort(tiny_checkpoint):
    """uvicorn failed to bind once the engine had started loading, and the interpreter aborted (exit 134)
    under the loading thread: the port is bound first now."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_server(tiny_checkpoint, "--port", str(port))
    assert result.returncode == 1, result.stderr
    one_error_line(result, f"cannot listen on --host 127.0.0.1 --port {port}", "Address already in use")


def test_a_host_that_does_not_resolve_exits_1_with_one_line_and_no_abort(tiny_checkpoint):
    result = run_server(tiny_checkpoint, "--host", "256.1.1.1")
    assert result.returncode == 1, result.stderr
    one_error_line(result, "cannot listen on --host 256.1.1.1")


def test_a_kv_cache_larger_than_any_machine_exits_2_before_allocating(tiny_checkpoint):
    """1e30 bytes failed in torch with a 19-line C++ trace; a size above the free memory stayed up, zeroing
    memory towards the OOM killer (tests/server/test_cli.py checks that one without a machine that large)."""
    result = run_server(tiny_checkpoint, "--kv-cache-memory", "1e30")
    assert result.returncode == 2, result.stderr
    one_error_line(result, "--kv-cache-memory asks for a KV cache of", "of memory available on this machine")


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("n_head", 0, "n_head must be a positive integer, got 0"),
        ("n_layer", 0, "n_layer must be a positive integer, got 0"),
        ("vocab_size", 0, "vocab_size must be a positive integer, got 0"),
        ("n_head", 5, "n_embd (32) must be divisible by n_head (5)"),
    ],
)
def test_a_shape_value_that_cannot_work_exits_1_naming_its_key(tiny_checkpoint, tmp_path, key, value, message):
    """n_head 0 was a ZeroDivisionError traceback."""
    directory = copy_of(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    result = run_server(directory)
    assert result.returncode == 1, result.stderr
    one_error_line(result, str(directory / "config.json"), message)


def test_an_unreadable_tokenizer_exits_1_naming_the_file(tiny_checkpoint, tmp_path):
    """The tokenizers library says 'Permission denied (os error 13)' or 'Input/output error (os error 5)' and
    names no file. Tests run as root, where a mode of 000 denies nothing: the file is a link to one whose
    read fails for root too (/proc/self/mem at offset 0)."""
    directory = copy_of(tiny_checkpoint, tmp_path)
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.json").symlink_to("/proc/self/mem")
    result = run_server(directory)
    assert result.returncode == 1, result.stderr
    one_error_line(result, f"{directory / 'tokenizer.json'} cannot be read as a tokenizer", "os error")


def test_an_unsupported_architecture_exits_1_naming_it(tiny_checkpoint, tmp_path):
    directory = copy_of(tiny_checkpoint, tmp_path)
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "vocab_size": 400}
    (directory / "config.json").write_text(json.dumps(mixtral))
    result = run_server(directory)
    assert result.returncode == 1, result.stderr
    one_error_line(
        result,
        "unsupported architecture MixtralForCausalLM (model_type mixtral); "
        "supported: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    )


def test_non_finite_weights_exit_1_naming_the_tensor(tiny_checkpoint, tmp_path):
    """Such a checkpoint started, reported healthy, then failed every request."""
    directory = copy_of(tiny_checkpoint, tmp_path)
    weights = load_file(str(directory / "model.safetensors"))
    weights["transformer.h.0.attn.c_attn.weight"][1, 2] = float("inf")
    save_file(weights, str(directory / "model.safetensors"))
    result = run_server(directory, "--log-level", "warning")
    assert result.returncode == 1, result.stderr
    one_error_line(result, "tensor transformer.h.0.attn.c_attn.weight holds NaN or infinite values")


def test_a_stop_while_the_engine_loads_waits_for_the_loading_then_stops_the_engine():
    """SIGTERM while the engine loaded let the interpreter exit under the loading thread, which aborted the
    process (exit 134, 'terminate called without an active exception'): the app's shutdown now waits for
    the loading to end, then shuts down what loaded."""
    from fastapi.testclient import TestClient

    from server.api.app import create_app

    loaded, engine = threading.Event(), MagicMock()
    engine.start.return_value = engine

    def load():
        loaded.wait(30)
        return engine

    threading.Timer(0.5, loaded.set).start()
    with TestClient(create_app(load, warmup=False)):
        pass  # the app stops at once, while its engine still loads
    engine.shutdown.assert_called_once()
