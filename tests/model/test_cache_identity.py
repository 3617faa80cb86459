"""Identical means identical: with the exact kernels, cached decoding gives the same logits, bit for
bit (torch.equal), as recomputing the whole sequence, at every step; a row gives the same bits in any
batch; chunked prefill gives the bits of one-shot prefill and of the decode path. Torch's own
kernels fail the same comparisons (the negative controls) and agree only within a tolerance."""

from __future__ import annotations

import os

import pytest
import torch

from model import kernels
from model.checkpoint import load_model
from model.config import GPTConfig
from model.generate import decode_one_token, generate, prefill, recompute, sequence_cache
from model.gpt import GPT
from model.kv_cache import PagedKVCache, StepBatch
from model.sampling import SamplingParams
from tests.conftest import EXACT, TEST_DEVICE, isa_params, needs_exact, random_model

SONNET = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, "
    "that thou her maid art far more fair than she. Be not her maid, since she is envious; "
    "her vestal livery is but sick and green, and none but fools do wear it; cast it off. "
    "It is my lady, O, it is my love! O, that she knew she were! She speaks, yet she says nothing. "
    "What of that? Her eye discourses; I will answer it. I am too bold, 'tis not to me she speaks: "
    "two of the fairest stars in all the heaven, having some business, do entreat her eyes to twinkle "
    "in their spheres till they return. What if her eyes were there, they in her head? The brightness "
    "of her cheek would shame those stars, as daylight doth a lamp; her eyes in heaven would through "
    "the airy region stream so bright that birds would sing and think it were not night. See how she "
    "leans her cheek upon her hand! O, that I were a glove upon that hand, that I might touch that cheek!"
)


def cached_and_uncached(model: GPT, ids: list[int], prompt_len: int, cache_dtype: torch.dtype | None = None):
    """Yields (position, cached logits, uncached logits) for the prompt's last token, then every later one."""
    cache, blocks = sequence_cache(model, len(ids), dtype=cache_dtype)
    scratch, scratch_blocks = sequence_cache(model, len(ids), dtype=cache_dtype)
    cached = prefill(model, cache, ids[:prompt_len], blocks)
    yield prompt_len - 1, cached, recompute(model, scratch, ids[:prompt_len], scratch_blocks)
    for t in range(prompt_len, len(ids)):
        cached = decode_one_token(model, cache, ids[t], t, blocks)
        yield t, cached, recompute(model, scratch, ids[: t + 1], scratch_blocks)


def assert_identical_every_step(
    model: GPT, ids: list[int], prompt_len: int, cache_dtype: torch.dtype | None = None
) -> int:
    steps = 0
    for t, cached, uncached in cached_and_uncached(model, ids, prompt_len, cache_dtype):
        assert torch.equal(cached, uncached), f"position {t}: max |diff| {(cached - uncached).abs().max():.3g}"
        steps += 1
    return steps


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@needs_exact
def test_default_model_cached_decode_is_bit_identical_to_recompute_for_230_steps(default_model, default_tokenizer):
    ids = default_tokenizer.encode(SONNET)
    assert len(ids) >= 230
    assert assert_identical_every_step(default_model, ids[:240], prompt_len=10) == 231


@needs_exact
@pytest.mark.parametrize("isa", isa_params("avx2", "avx512"), indirect=True)
@pytest.mark.parametrize("n_embd, n_head", [(64, 4), (128, 2), (32, 4)], ids=["hd16", "hd64", "hd8"])
def test_random_model_cached_decode_is_bit_identical_to_recompute(isa, n_embd, n_head):
    model = random_model(GPTConfig(vocab_size=300, n_positions=256, n_embd=n_embd, n_layer=3, n_head=n_head), seed=1)
    assert assert_identical_every_step(model, random_ids(230, 300), prompt_len=20) == 211


@needs_exact
@pytest.mark.parametrize("isa", isa_params("avx2", "avx512", "avx512-vnni"), indirect=True)
def test_bfloat16_cached_decode_is_bit_identical_to_recompute(isa, default_checkpoint, default_tokenizer):
    model = load_model(default_checkpoint, device=TEST_DEVICE, dtype=torch.bfloat16)
    assert model.kernels == "exact"
    ids = default_tokenizer.encode(SONNET)[:215]
    assert assert_identical_every_step(model, ids, prompt_len=8) == 208


@needs_exact
@pytest.mark.parametrize("isa", isa_params("avx2", "avx512"), indirect=True)
def test_an_int8_kv_cache_decodes_cached_to_the_bits_of_recompute(isa, default_model, default_tokenizer):
    """Keys and values quantized when written, per (token, head): what recompute writes and reads is what the
    cached decode wrote and reads, so the identity holds on the int8 cache as on a float one."""
    ids = default_tokenizer.encode(SONNET)[:150]
    assert assert_identical_every_step(default_model, ids, prompt_len=8, cache_dtype=torch.int8) == 143


@needs_exact
def test_an_int8_kv_cache_keeps_the_default_models_next_token_distributions(default_model, default_tokenizer):
    """Over the sonnet, every position's next-token distribution with the int8 cache stays within 1e-4 nats (mean
    KL) of the float32 cache's, and its most likely token is float32's at 98% of positions or more."""
    ids = default_tokenizer.encode(SONNET)[:200]

    def logprobs(cache_dtype):
        cache, blocks = sequence_cache(default_model, len(ids), dtype=cache_dtype)
        step = StepBatch.build([(ids, 0, blocks)], cache.block_size, default_model.device)
        return default_model.compute_logits(default_model.forward_step(step, cache)).log_softmax(-1)  # (T, V)

    exact, int8 = logprobs(torch.float32), logprobs(torch.int8)
    assert not torch.equal(exact, int8)  # the cache is int8: not float32's bits
    kl = (exact.exp() * (exact - int8)).sum(-1)  # (T,)
    assert kl.mean() < 1e-4, kl.mean()
    assert (exact.argmax(-1) == int8.argmax(-1)).float().mean() >= 0.98


@needs_exact
@pytest.mark.parametrize("batch", [1, 3, 8, 32])
def test_a_row_decodes_to_the_same_bits_in_any_batch_and_position(default_model, batch):
    """Sequence 0 decodes among `batch - 1` others of other lengths, at a new place in the batch every
    step; each of its logits equals the ones it gets alone."""
    model, steps, bs = default_model, 12, 16
    lengths = [40] + [5 + 17 * i % 90 for i in range(1, batch)]
    seqs = [random_ids(n + steps, model.config.vocab_size, seed=i) for i, n in enumerate(lengths)]
    alone = []
    cache, blocks = sequence_cache(model, len(seqs[0]))
    alone.append(prefill(model, cache, seqs[0][:40], blocks))
    for t in range(40, 40 + steps):
        alone.append(decode_one_token(model, cache, seqs[0][t], t, blocks))
    width = -(-(max(lengths) + steps) // bs)
    shared = PagedKVCache(model.config, batch * width, bs, device=model.device)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    order = torch.Generator().manual_seed(batch)
    step = StepBatch.build([(s[:n], 0, tables[i]) for i, (s, n) in enumerate(zip(seqs, lengths))], bs, model.device)
    hidden = model.forward_step(step, shared)
    ends = step.query_start[1:].long() - 1
    logits = model.compute_logits(hidden[ends])
    assert torch.equal(logits[0:1], alone[0])
    for k in range(steps):
        perm = torch.randperm(batch, generator=order).tolist()
        step = StepBatch.build([([seqs[i][lengths[i] + k]], lengths[i] + k, tables[i]) for i in perm], bs, model.device)
        logits = model.compute_logits(model.forward_step(step, shared))
        row = perm.index(0)
        assert torch.equal(logits[row : row + 1], alone[k + 1]), f"step {k}: row at place {row} of {batch} differs"


@needs_exact
@pytest.mark.parametrize("chunk", [1, 7, 16, 128])
def test_chunked_prefill_equals_one_shot_prefill_and_the_decode_path(default_model, chunk):
    model = default_model
    ids = random_ids(200, model.config.vocab_size, seed=7)
    one_cache, blocks = sequence_cache(model, 200)
    one_shot = model.compute_logits(model.forward_step(StepBatch.build([(ids, 0, blocks)], 16), one_cache))
    cache, _ = sequence_cache(model, 200)
    chunked = torch.cat(
        [
            model.compute_logits(model.forward_step(StepBatch.build([(ids[s : s + chunk], s, blocks)], 16), cache))
            for s in range(0, 200, chunk)
        ]
    )
    assert torch.equal(chunked, one_shot)
    decode_cache, _ = sequence_cache(model, 200)
    decoded = torch.cat([decode_one_token(model, decode_cache, tok, t, blocks) for t, tok in enumerate(ids)])
    assert torch.equal(decoded, one_shot)


# ---- the stock kernels: a tolerance, and the negative controls --------------------------------------


def max_cached_vs_uncached(model: GPT, ids: list[int], prompt_len: int) -> float:
    return max((c - u).abs().max().item() for _, c, u in cached_and_uncached(model, ids, prompt_len))


@pytest.fixture(scope="module")
def stock_default_model(default_checkpoint):
    return load_model(default_checkpoint, device=TEST_DEVICE, kernels="stock")


def test_negative_control_stock_kernels_are_not_bit_identical(stock_default_model, default_tokenizer):
    ids = default_tokenizer.encode(SONNET)[:80]
    differs = [not torch.equal(c, u) for _, c, u in cached_and_uncached(stock_default_model, ids, prompt_len=10)]
    assert any(differs), "torch's kernels gave bit-identical logits: the exact tests above would not have teeth"


# The stock kernels' tolerances (docs/how-it-works/identical.md): float32 cached and uncached logits
# agree within 1e-4 (|logit| up to ~20 here), float64 within 1e-10, bfloat16 and float16 within two
# units of their spacing at |logit| in [8, 16).
# (bfloat16 products are slow on a CPU through torch: a shorter text there; float16 ones slower still, so
# float16 runs on a GPU only: bench/gpu_check.sh.)
@pytest.mark.parametrize(
    "dtype, atol, length",
    [
        (torch.float32, 1e-4, 120),
        (torch.float64, 1e-10, 120),
        (torch.bfloat16, 2 / 16, 40),
        pytest.param(torch.float16, 2 / 128, 120, marks=pytest.mark.skipif(TEST_DEVICE == "cpu", reason="GPU only")),
    ],
)
def test_stock_kernels_agree_within_their_tolerance(default_checkpoint, default_tokenizer, dtype, atol, length):
    model = load_model(default_checkpoint, device=TEST_DEVICE, dtype=dtype, kernels="stock")
    ids = default_tokenizer.encode(SONNET)[:length]
    assert max_cached_vs_uncached(model, ids, prompt_len=8) <= atol


def test_exact_and_stock_kernels_agree_within_float32_tolerance(default_model, stock_default_model, default_tokenizer):
    ids = default_tokenizer.encode(SONNET)[:60]
    for (_, exact, _), (_, stock, _) in zip(
        cached_and_uncached(default_model, ids, 10), cached_and_uncached(stock_default_model, ids, 10)
    ):
        torch.testing.assert_close(exact, stock, atol=1e-4, rtol=0)


def greedy_ids(model, tokenizer, prompt, n, use_cache):
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return [s.token_id for s in generate(model, tokenizer, prompt, params, use_cache=use_cache)]


def test_default_model_greedy_220_tokens_same_ids_with_and_without_cache(default_model, default_tokenizer):
    cached = greedy_ids(default_model, default_tokenizer, "KING HENRY:\n", 220, use_cache=True)
    uncached = greedy_ids(default_model, default_tokenizer, "KING HENRY:\n", 220, use_cache=False)
    assert len(cached) == 220
    assert cached == uncached


def test_suite_runs_the_kernels_it_claims(default_model):
    assert default_model.kernels == ("exact" if EXACT else "stock")


def test_the_exact_kernels_build_on_a_cpu_unless_the_stock_ones_are_asked_for():
    """The exact kernels carry the bit-identity claim, and the tests of it are skipped where they cannot
    run: on a CPU this one fails instead, saying why, unless KVSERVE_KERNELS=stock says so on purpose."""
    if TEST_DEVICE != "cpu" or os.environ.get("KVSERVE_KERNELS") == "stock":
        pytest.skip("not a CPU run, or the stock kernels were asked for (KVSERVE_KERNELS=stock)")
    assert EXACT, (
        f"the exact kernels did not build here, so their tests were skipped: "
        f"{kernels.unavailable_reason()} (g++ and AVX2 are needed; KVSERVE_KERNELS=stock skips them)"
    )
