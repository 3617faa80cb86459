"""Shared fixtures: the device under test, a tiny random model and tokenizer, and the committed
default checkpoint.

The suite runs on the CPU; `KVSERVE_TEST_DEVICE=cuda pytest` runs the same tests on a GPU
(bench/gpu_check.sh). The device travels explicitly, through the `device` fixture and TEST_DEVICE,
never through torch's default device: code that forgets `device=` fails there as it would in production.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from model import kernels
from model.checkpoint import DEFAULT_CHECKPOINT, load_model, load_tokenizer, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.kernels.library import configured_isa
from model.tokenizer import train_tokenizer

TEST_DEVICE = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")
# Which kernels the suite's models run: the exact ones on a CPU that builds them, else torch's.
EXACT = kernels.kernels_for(torch.device(TEST_DEVICE), torch.float32) == "exact"
needs_exact = pytest.mark.skipif(
    not EXACT, reason=f"the exact kernels do not run here: {kernels.unavailable_reason() or TEST_DEVICE}"
)
CPU_ISAS = kernels.cpu_isas() if EXACT else ()  # the instruction-set levels this CPU has (model.kernels.library)


def isa_params(*levels: str) -> list:
    """pytest params for the `isa` fixture: each level, skipped with the reason where the CPU lacks it."""
    params = []
    for level in levels:
        reason = f"this CPU lacks {level} (it has {', '.join(CPU_ISAS) or 'no exact kernels'})"
        if level == "avx-vnni":
            reason += ": the AVX-VNNI path is compiled into the library but not run here"
        params.append(pytest.param(level, id=level, marks=pytest.mark.skipif(level not in CPU_ISAS, reason=reason)))
    return params


@contextmanager
def forced_isa(level: str):
    """The kernels capped at instruction-set level `level` (KVSERVE_ISA's values) inside, the configured
    level after. Pack weights inside: bfloat16 ones are packed for the level in force."""
    kernels.set_isa(level)
    try:
        yield level
    finally:
        kernels.set_isa(configured_isa())


@pytest.fixture
def isa(request):
    """The instruction-set level a test runs under, from its params (isa_params, indirect=True); a test
    module that runs all its tests per level overrides it with a parametrized one."""
    with forced_isa(request.param):
        yield request.param


TINY_TEXT = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune. 世界你好，莎士比亚。 Emoji 🤖🎭 and naïve café. "
) * 20


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer([TINY_TEXT], vocab_size=400)


@pytest.fixture(scope="session")
def tiny_config(tiny_tokenizer) -> GPTConfig:
    return GPTConfig(
        vocab_size=tiny_tokenizer.vocab_size,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        eos_token_id=tiny_tokenizer.eos_token_id,
    )


def random_model(
    config: GPTConfig,
    seed: int = 0,
    device: str | torch.device = TEST_DEVICE,
    dtype: torch.dtype = torch.float32,
    kernels_name: str = "auto",
) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=dtype).prepare_for_inference(kernels_name)


@pytest.fixture(scope="session")
def tiny_model(tiny_config) -> GPT:
    return random_model(tiny_config)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """A random tiny model saved as a full checkpoint directory."""
    return save_checkpoint(tiny_model, tiny_tokenizer, tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    if not (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        pytest.fail(f"the default checkpoint is missing from {DEFAULT_CHECKPOINT}")
    return DEFAULT_CHECKPOINT


@pytest.fixture(scope="session")
def default_model(default_checkpoint):
    return load_model(default_checkpoint, device=TEST_DEVICE)


@pytest.fixture(scope="session")
def default_tokenizer(default_checkpoint):
    return load_tokenizer(default_checkpoint)
