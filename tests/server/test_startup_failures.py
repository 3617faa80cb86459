"""Bad process input ends `python -m server` at once, so a supervisor sees it (issue 23): a bad flag value
exits 2 before anything loads; a checkpoint that cannot be loaded exits 1 with one line saying why and no
traceback (unless --log-level debug), never leaving an unhealthy process holding its port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_DEVICE

ROOT = Path(__file__).parents[2]
GUARD_S = 120  # only a guard against a hang: a failing start takes seconds


def run_server(checkpoint: Path, *flags: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--checkpoint",
        str(checkpoint),
        "--port",
        str(port),
        "--device",
        TEST_DEVICE,
        "--threads",
        "1",
        *flags,
    ]
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
