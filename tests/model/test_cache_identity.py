"""Cached decoding gives the same logits as recomputing the whole sequence, step by step."""
from __future__ import annotations

import shutil

import pytest
import torch

from model.checkpoint import load_model
from model.config import GPTConfig
from model.generate import decode_one_token, full_recompute, generate, prefill
from model.gpt import GPT
from model.kv_cache import KVCache
from model.sampling import SamplingParams
from tests.conftest import TEST_DEVICE


def cached_vs_full_logits(model: GPT, ids: torch.Tensor, prompt_len: int, slot: int = 1, kv_len=None):
    """Yields (step, cached logits, full-recompute logits) for prefill then every decode step. The
    full recompute runs the whole prefix ids[:, :t + 1] again without a cache, as uncached decoding does."""
    cache = KVCache(model.config, num_slots=3, dtype=next(model.parameters()).dtype)
    slots = torch.tensor([slot])
    with torch.inference_mode():
        logits = prefill(model, cache, ids[:, :prompt_len], torch.arange(prompt_len)[None], slots,
                         torch.tensor([prompt_len - 1]), kv_len=kv_len)
        yield prompt_len - 1, logits[0], full_recompute(model, ids[:, :prompt_len])[0]
        for t in range(prompt_len, ids.shape[1]):
            logits = decode_one_token(model, cache, ids[:, t], torch.tensor([t]), slots, kv_len=kv_len)
            yield t, logits[0], full_recompute(model, ids[:, : t + 1])[0]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_random_model_cached_logits_match_full_recompute(dtype, atol):
    torch.manual_seed(1)
    config = GPTConfig(vocab_size=300, n_positions=160, n_embd=64, n_layer=3, n_head=4)
    model = GPT(config).to(dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, 150))
    steps = 0
    with torch.inference_mode():
        for t, cached, full in cached_vs_full_logits(model, ids, prompt_len=20):
            torch.testing.assert_close(cached, full, atol=atol, rtol=0, msg=lambda m: f"step {t}: {m}")
            steps += 1
    assert steps == 131  # prefill + 130 decode steps


# Half-precision weights (`--dtype bfloat16/float16`) have their own tolerance: the logits come back in
# that dtype, whose spacing at |logit| in [8, 16) is 1/16 (bfloat16) and 1/128 (float16); two units.
# float16 matmuls are slow on a CPU (~25 s here), so that case runs on a GPU only (bench/gpu_check.sh).
HALF_TOLERANCES = [(torch.bfloat16, 2 / 16), pytest.param(torch.float16, 2 / 128, marks=pytest.mark.skipif(
    TEST_DEVICE == "cpu", reason="float16 on a CPU is slow; the GPU run covers it"))]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-10), *HALF_TOLERANCES])
def test_default_model_cached_logits_match_full_recompute(default_checkpoint, default_tokenizer, dtype, atol):
    model = load_model(default_checkpoint, device=TEST_DEVICE, dtype=dtype)
    ids = torch.tensor([default_tokenizer.encode(
        "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, "
        "that thou her maid art far more fair than she. Be not her maid, since she is envious; "
        "her vestal livery is but sick and green, and none but fools do wear it; cast it off. "
        "It is my lady, O, it is my love! O, that she knew she were! She speaks, yet she says nothing."
    )])
    assert ids.shape[1] >= 110
    with torch.inference_mode():
        for t, cached, full in cached_vs_full_logits(model, ids, prompt_len=8, kv_len=None):
            torch.testing.assert_close(cached, full, atol=atol, rtol=0, msg=lambda m: f"step {t}: {m}")


def test_attending_over_only_the_filled_columns_changes_nothing(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 60))
    with torch.inference_mode():
        for t, cached, full in cached_vs_full_logits(tiny_model, ids, prompt_len=5, kv_len=61):
            torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)


def greedy_ids(model, tokenizer, prompt, n, use_cache):
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return [s.token_id for s in generate(model, tokenizer, prompt, params, use_cache=use_cache)]


def test_default_model_greedy_200_tokens_same_ids_with_and_without_cache(default_model, default_tokenizer):
    cached = greedy_ids(default_model, default_tokenizer, "KING HENRY:\n", 220, use_cache=True)
    uncached = greedy_ids(default_model, default_tokenizer, "KING HENRY:\n", 220, use_cache=False)
    assert len(cached) == 220
    assert cached == uncached


def test_random_model_greedy_same_ids_with_and_without_cache(tiny_model, tiny_tokenizer):
    cached = greedy_ids(tiny_model, tiny_tokenizer, "To be", 100, use_cache=True)
    uncached = greedy_ids(tiny_model, tiny_tokenizer, "To be", 100, use_cache=False)
    assert cached == uncached


needs_cxx = pytest.mark.skipif(TEST_DEVICE == "cpu" and not (shutil.which("g++") or shutil.which("c++")),
                               reason="torch.compile on the CPU needs a C++ compiler")


@needs_cxx
@pytest.mark.parametrize("slots", [slice(1, 2), torch.tensor([2, 0])], ids=["one-row-range", "two-row-gather"])
def test_compiled_decode_matches_eager_decode_and_full_recompute(default_model, slots):
    model, B = default_model, 1 if isinstance(slots, slice) else 2
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (B, 40))
    caches = [KVCache(model.config, num_slots=3, max_len=64) for _ in range(2)]  # eager, compiled
    with torch.inference_mode():
        for cache in caches:
            prefill(model, cache, ids[:, :30], torch.arange(30).expand(B, -1), slots, torch.full((B,), 29))
        for t in range(30, 40):
            pos = torch.full((B,), t)
            eager = decode_one_token(model, caches[0], ids[:, t], pos, slots, kv_len=t + 1)  # (B, V)
            compiled = decode_one_token(model, caches[1], ids[:, t], pos, slots, kv_len=t + 1, compiled=True)
            full = full_recompute(model, ids[:, : t + 1])  # (B, V)
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0, msg=lambda m: f"step {t}: {m}")
            torch.testing.assert_close(compiled, full, atol=1e-5, rtol=0, msg=lambda m: f"step {t}: {m}")
