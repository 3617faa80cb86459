"""Training runs and improves on a tiny corpus; its checkpoint reloads; the CLI prints only text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from model.checkpoint import load_model, load_tokenizer
from model.train import main as train_main
from tests.conftest import TINY_TEXT

REPO = Path(__file__).resolve().parents[2]


def tiny_run(tmp_path, out, steps, *extra):
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    (corpus / "a.txt").write_text(TINY_TEXT * 3)
    (corpus / "b.txt").write_text(TINY_TEXT[::-1] * 2)
    return train_main(
        [
            "--data",
            str(corpus / "a.txt"),
            "--val",
            str(corpus / "b.txt"),
            "--out",
            str(out),
            "--preset",
            "tiny",
            "--vocab-size",
            "300",
            "--block-size",
            "32",
            "--batch-size",
            "8",
            "--max-steps",
            str(steps),
            "--warmup",
            "5",
            "--lr",
            "3e-3",
            "--eval-interval",
            "10",
            "--eval-batches",
            "2",
            "--dropout",
            "0.0",
            *extra,
        ]
    )


def test_training_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    summary = tiny_run(tmp_path, out, 40)
    history = summary["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.5
    assert summary["val_bits_per_byte"] > 0
    model, tokenizer = load_model(out), load_tokenizer(out)
    assert model.config.vocab_size == tokenizer.vocab_size <= 300
    ids = torch.tensor([tokenizer.encode("To be")])
    assert model(ids).shape == (1, ids.shape[1], tokenizer.vocab_size)
    assert json.loads((out / "training.json").read_text())["steps"] == 40


def test_training_resumes_from_its_own_state(tmp_path):
    out = tmp_path / "ckpt"
    tiny_run(tmp_path, out, 10)
    resumed = tiny_run(tmp_path, out, 20, "--resume")
    assert resumed["steps"] == 20
    assert [h["step"] for h in resumed["history"]] == [10, 20]


def test_generate_cli_prints_only_the_generated_text(tiny_checkpoint):
    cmd = [
        sys.executable,
        "-m",
        "model.generate",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "To be",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ]
    cached = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    uncached = subprocess.run(cmd + ["--no-cache"], capture_output=True, text=True, cwd=REPO, check=True)
    assert cached.stdout == uncached.stdout and cached.stdout.strip()
    assert "tok/s" in cached.stderr and "tok/s" not in cached.stdout


def test_generate_cli_reports_a_bad_prompt_on_stderr(tiny_checkpoint):
    cmd = [sys.executable, "-m", "model.generate", "--checkpoint", str(tiny_checkpoint), "--prompt", ""]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "empty" in result.stderr and result.stdout == ""
