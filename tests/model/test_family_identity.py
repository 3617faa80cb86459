"""Identical means identical, for the Llama, Qwen2 and Qwen3 families too: with the exact kernels
(csrc/decoder.cpp), cached decoding gives the same logits, bit for bit (torch.equal), as recomputing the whole
sequence at every step; a row gives the same bits alone and in any batch at any place; chunked prefill gives
the bits of one-shot prefill and of the decode path; a sequence whose prefix blocks come from another's (a
prefix-cache hit) gives the bits of computing its prefix itself. Each for float32, bfloat16 and int8 weights,
on every instruction-set path of theirs the CPU has. Torch's kernels fail the same comparisons (the negative
control) and agree within 1e-4; the exact step agrees with transformers within 1e-4."""

from __future__ import annotations

import pytest
import torch

from model.generate import decode_one_token, prefill, sequence_cache
from model.kv_cache import PagedKVCache, StepBatch
from model.models import load_model
from tests.conftest import CPU_ISAS, forced_isa, isa_params, needs_exact
from tests.model.hf_families import EXACT_CASES, VOCAB, hf_model, random_decoder, save
from tests.model.test_cache_identity import assert_identical_every_step, cached_and_uncached, random_ids

pytestmark = needs_exact
FAMILIES = sorted(EXACT_CASES)
# Each kind of weights and the levels that pick each of its paths (the bfloat16 one at avx512-vnni: AVX512-BF16).
PATHS = {
    "float32": ("avx2", "avx512"),
    "bfloat16": ("avx2", "avx512", "avx512-vnni"),
    "int8": ("avx2", "avx-vnni", "avx512-vnni", "amx"),
}
WEIGHTS = list(PATHS)
BS = 16


def exact_model(name: str, weights: str, seed: int = 0):
    """The case's model on the exact kernels with `weights`, packed for the level in force."""
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    quantization = "int8" if weights == "int8" else None
    model = random_decoder(name, seed=seed, dtype=dtype).prepare_for_inference("exact", quantization)
    assert (model.kernels, model.quantization) == ("exact", quantization)
    return model


def isa_marks(weights: str, level: str):
    """The skip mark of a level this CPU lacks (conftest.isa_params)."""
    return [m for p in isa_params(*PATHS[weights]) if p.values[0] == level for m in p.marks]


@pytest.mark.parametrize(
    "name, weights, level",
    [
        pytest.param(name, weights, level, id=f"{name}-{weights}-{level}", marks=isa_marks(weights, level))
        for name in FAMILIES
        for weights in WEIGHTS
        for level in PATHS[weights]
    ],
)
def test_cached_decode_is_bit_identical_to_recompute_on_every_path(name, weights, level):
    with forced_isa(level):
        model = exact_model(name, weights)
        assert model.kernel_isa is not None
        assert assert_identical_every_step(model, random_ids(110, VOCAB), prompt_len=20) == 91


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("quantization", [None, "int8"], ids=["float32", "int8"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8], ids=["bf16cache", "int8cache"])
def test_a_narrower_kv_cache_decodes_cached_to_the_bits_of_recompute(name, quantization, cache_dtype):
    model = random_decoder(name).prepare_for_inference("exact", quantization)
    assert assert_identical_every_step(model, random_ids(70, VOCAB), prompt_len=10, cache_dtype=cache_dtype) == 61


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("level", isa_params("avx2", "avx512"))
def test_an_int8_kv_cache_under_bfloat16_decodes_cached_to_the_bits_of_recompute_on_every_path(name, level):
    with forced_isa(level):
        model = exact_model(name, "bfloat16")
        assert assert_identical_every_step(model, random_ids(50, VOCAB), prompt_len=10, cache_dtype=torch.int8) == 41


@pytest.fixture(scope="module", params=[(n, w) for n in FAMILIES for w in WEIGHTS], ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    return exact_model(*request.param)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_row_decodes_to_the_same_bits_in_any_batch_and_position(model, batch):
    """Sequence 0 decodes among `batch - 1` others of other lengths, at a new place in the batch every step;
    each of its logits equals the ones it gets alone."""
    steps, first = 8, 30
    lengths = [first] + [3 + 13 * i % 50 for i in range(1, batch)]
    seqs = [random_ids(n + steps, VOCAB, seed=i) for i, n in enumerate(lengths)]
    cache, blocks = sequence_cache(model, len(seqs[0]))
    alone = [prefill(model, cache, seqs[0][:first], blocks)]
    alone += [decode_one_token(model, cache, seqs[0][t], t, blocks) for t in range(first, first + steps)]
    width = -(-(max(lengths) + steps) // BS)
    shared = PagedKVCache(model.config, batch * width, BS, dtype=model.dtype, device=model.device)
    tables = [list(range(i * width, (i + 1) * width))[::-1] for i in range(batch)]  # blocks out of order
    step = StepBatch.build([(s[:n], 0, tables[i]) for i, (s, n) in enumerate(zip(seqs, lengths))], BS, model.device)
    logits = model.compute_logits(model.forward_step(step, shared)[step.query_start[1:].long() - 1])
    assert torch.equal(logits[0:1], alone[0])
    order = torch.Generator().manual_seed(batch)
    for k in range(steps):
        perm = torch.randperm(batch, generator=order).tolist()
        step = StepBatch.build([([seqs[i][lengths[i] + k]], lengths[i] + k, tables[i]) for i in perm], BS, model.device)
        logits = model.compute_logits(model.forward_step(step, shared))
        row = perm.index(0)
        assert torch.equal(logits[row : row + 1], alone[k + 1]), f"step {k}: row at place {row} of {batch} differs"


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
def test_chunked_prefill_equals_one_shot_prefill_and_the_decode_path(model, chunk):
    ids = random_ids(100, VOCAB, seed=7)
    one_cache, blocks = sequence_cache(model, 100)
    one_shot = model.compute_logits(model.forward_step(StepBatch.build([(ids, 0, blocks)], BS), one_cache))
    cache, _ = sequence_cache(model, 100)
    chunked = torch.cat(
        [
            model.compute_logits(model.forward_step(StepBatch.build([(ids[s : s + chunk], s, blocks)], BS), cache))
            for s in range(0, 100, chunk)
        ]
    )
    assert torch.equal(chunked, one_shot)
    decode_cache, _ = sequence_cache(model, 100)
    decoded = torch.cat([decode_one_token(model, decode_cache, tok, t, blocks) for t, tok in enumerate(ids)])
    assert torch.equal(decoded, one_shot)


def test_a_prefix_hit_gives_the_bits_of_computing_the_prefix(model):
    """B shares A's first 48 tokens: its block table starts with A's three full blocks (as the engine's prefix
    cache hands them over) and only its own tokens run; every logit equals B computed from scratch."""
    a = random_ids(64, VOCAB, seed=11)
    b = a[:48] + random_ids(30, VOCAB, seed=12)
    cache = PagedKVCache(model.config, 12, BS, dtype=model.dtype, device=model.device)
    model.forward_step(StepBatch.build([(a, 0, [3, 8, 1, 6])], BS), cache)
    step = StepBatch.build([(b[48:], 48, [3, 8, 1, 10, 11])], BS)
    hit = model.compute_logits(model.forward_step(step, cache))  # (30, V)
    scratch, blocks = sequence_cache(model, len(b))
    from_scratch = model.compute_logits(model.forward_step(StepBatch.build([(b, 0, blocks)], BS), scratch))
    assert torch.equal(hit, from_scratch[48:])


@pytest.mark.parametrize("name", FAMILIES)
def test_every_float32_and_int8_path_gives_the_avx2_paths_bits(name):
    """The products' paths differ only in how many lanes share a load (float32) or in how the exact int32 sums
    are formed (int8): a family model's logits are the same bits on each."""
    ids = random_ids(40, VOCAB, seed=3)
    for weights in ("float32", "int8"):
        results = {}
        for level in [lvl for lvl in PATHS[weights] if lvl in CPU_ISAS]:
            with forced_isa(level):
                model = exact_model(name, weights)
                cache, blocks = sequence_cache(model, len(ids))
                hidden = model.forward_step(StepBatch.build([(ids, 0, blocks)], BS), cache)  # (T, C)
                results[level] = model.compute_logits(hidden)
        assert all(torch.equal(r, results["avx2"]) for r in results.values()), f"{weights}: {list(results)}"


# ---- the stock kernels: the negative control and a tolerance; parity with transformers -------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_negative_control_stock_kernels_are_not_bit_identical(name):
    model = random_decoder(name).prepare_for_inference("stock")
    differs = [not torch.equal(c, u) for _, c, u in cached_and_uncached(model, random_ids(60, VOCAB), 10)]
    assert any(differs), "torch's kernels gave bit-identical logits: the exact tests above would not have teeth"


@pytest.mark.parametrize("name", FAMILIES)
def test_exact_and_stock_kernels_agree_within_float32_tolerance(name):
    exact, stock = exact_model(name, "float32"), random_decoder(name).prepare_for_inference("stock")
    ids = random_ids(60, VOCAB, seed=5)
    for (_, ours, _), (_, theirs, _) in zip(cached_and_uncached(exact, ids, 10), cached_and_uncached(stock, ids, 10)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_exact_step_matches_transformers(name, tmp_path):
    """A transformers checkpoint loaded by model.models.load_model: the exact step's prompt logprobs within 1e-4
    of transformers' (float32), and the same greedy tokens as transformers' generate, decoding cached."""
    pytest.importorskip("transformers")
    hf = hf_model(name)
    model = load_model(save(hf, tmp_path), device="cpu").prepare_for_inference("exact")
    assert model.kernels == "exact"
    ids = random_ids(50, VOCAB, seed=9)
    cache, blocks = sequence_cache(model, 50 + 24)
    hidden = model.forward_step(StepBatch.build([(ids, 0, blocks)], BS), cache)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # (50, V)
        ours = model.compute_logits(hidden).log_softmax(-1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        prompt = torch.tensor([ids])
        generated = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),  # (else generate takes the prompt's id 0 for padding)
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
        )[0, 50:].tolist()
    tokens, logits = [], model.compute_logits(hidden[-1:])
    for t in range(50, 74):
        tokens.append(int(logits.argmax(-1)))
        logits = decode_one_token(model, cache, tokens[-1], t, blocks)
    assert tokens == generated
