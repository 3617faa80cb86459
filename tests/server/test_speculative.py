"""Speculative decoding with n-gram drafts changes nothing but the number of steps: every output equals
decoding without it, token for token and logprob for logprob (torch.equal), for greedy and seeded
sampling, penalties, prefix-cache hits, preemption, mixed batches and stop strings; rejected
positions leave no trace. The model is the tiny random one with its embedding scaled up, so its
distributions are peaked and it repeats itself (drafts get accepted, and rejected)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model.kv_cache import PagedKVCache, StepBatch
from model.sampling import SamplingParams
from server.engine import Engine
from tests.conftest import needs_exact, random_model
from tests.server.conftest import check_block_invariants

pytestmark = needs_exact  # bit-equality across batch shapes is what the exact kernels give

GREEDY = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=60, temperature=1.5, top_k=20, top_p=0.9, seed=3, ignore_eos=True, logprobs=3)
PENALIZED = SamplingParams(
    max_new_tokens=60,
    temperature=0,
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    logit_bias=((7, 0.5),),
    ignore_eos=True,
)
PENALIZED_SAMPLED = SamplingParams(
    max_new_tokens=60, temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.1, seed=11, ignore_eos=True
)


@pytest.fixture(scope="module")
def peaked_model(tiny_config):
    model = random_model(tiny_config)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(12)  # sharper logits: the tiny model loops, as trained ones do
    return model.prepare_for_inference("exact")


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer):
    return tiny_tokenizer.encode("To be, or not to be, that is the question: Whether 'tis nobler")


def engine(model, tokenizer, spec: bool, **kw) -> Engine:
    return Engine(model, tokenizer, threads=1, **{"max_num_seqs": 8, "speculative": "ngram" if spec else None, **kw})


def run(eng: Engine, requests: list[tuple[list[int], SamplingParams, dict]]):
    """Submits every (prompt, params, submit keywords) to a stopped engine, steps until all finish.
    Returns each one's events and how many events each step gave it."""
    events = [[] for _ in requests]
    for (ids, params, kw), sink in zip(requests, events):
        eng.submit(ids, params, sink.append, **kw)
    per_step = [[] for _ in requests]
    while not all(e and e[-1].finished for e in events):
        before = [len(e) for e in events]
        eng.step()
        for i, e in enumerate(events):
            per_step[i].append(len(e) - before[i])
    return events, per_step


def tokens(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def logprobs(events) -> torch.Tensor:
    return torch.tensor([e.logprob for e in events if e.token_id is not None], dtype=torch.float64)


def assert_same(spec_events, plain_events) -> None:
    assert tokens(spec_events) == tokens(plain_events), "speculation changed the tokens"
    assert torch.equal(logprobs(spec_events), logprobs(plain_events)), "speculation changed the logprobs"
    assert [e.top_logprobs for e in spec_events] == [e.top_logprobs for e in plain_events]
    assert spec_events[-1].finish_reason == plain_events[-1].finish_reason
    assert spec_events[-1].text == plain_events[-1].text if spec_events[-1].token_id is not None else True


def solo_plain(model, tokenizer, ids, params, **kw):
    return run(engine(model, tokenizer, False), [(ids, params, kw)])[0][0]


@pytest.mark.parametrize(
    "params",
    [GREEDY, SAMPLED, PENALIZED, PENALIZED_SAMPLED],
    ids=["greedy", "seeded-top-k-top-p", "penalties", "penalties-sampled"],
)
def test_speculative_output_equals_plain_bit_for_bit(peaked_model, tiny_tokenizer, prompt, params):
    plain = solo_plain(peaked_model, tiny_tokenizer, prompt, params)
    eng = engine(peaked_model, tiny_tokenizer, True)
    (spec,), _ = run(eng, [(prompt, params, {})])
    assert_same(spec, plain)
    stats = spec[-1].stats
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0, "the speculative path was not taken"
    check_block_invariants(eng.blocks)


def test_seeded_sampling_both_accepts_and_rejects_drafts(peaked_model, tiny_tokenizer, prompt):
    eng = engine(peaked_model, tiny_tokenizer, True)
    run(eng, [(prompt, SAMPLED, {})])
    s = eng.drafter.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s


def test_a_repetitive_prompt_accepts_over_half_of_its_drafts(peaked_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("the slings and arrows of outrageous fortune, " * 4)
    eng = engine(peaked_model, tiny_tokenizer, True)
    (events,), per_step = run(eng, [(ids, GREEDY, {})])
    s = eng.drafter.stats
    assert s.num_drafts > 0 and s.num_accepted_tokens / s.num_draft_tokens > 0.5, s
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert len(per_step[0]) < len(tokens(events)), "no step gave more than one token"


def test_a_prefix_cache_hit_with_speculation_equals_plain(peaked_model, tiny_tokenizer, prompt):
    long_prompt, greedy = (prompt * 5)[:70], replace(GREEDY, max_new_tokens=40)
    plain = solo_plain(peaked_model, tiny_tokenizer, long_prompt, greedy)
    eng = engine(peaked_model, tiny_tokenizer, True)
    run(eng, [(long_prompt, replace(SAMPLED, max_new_tokens=40), {})])  # caches the prompt's blocks, rejects drafts
    (hit,), _ = run(eng, [(long_prompt, greedy, {})])
    assert hit[-1].stats.cached_tokens == 64
    assert_same(hit, plain)
    continuation = long_prompt + tokens(hit)[:30]  # its own output, read back from the prefix cache
    (again,), _ = run(eng, [(continuation, replace(GREEDY, max_new_tokens=28), {})])
    assert again[-1].stats.cached_tokens == 96
    assert_same(again, solo_plain(peaked_model, tiny_tokenizer, continuation, replace(GREEDY, max_new_tokens=28)))
    check_block_invariants(eng.blocks)


def test_a_repeat_drafts_from_the_first_requests_output_and_another_salt_does_not(peaked_model, tiny_tokenizer, prompt):
    """Seeded sampling rarely repeats itself, so the first request's own look-ups seldom come true; the
    same request again finds its whole output in the engine's shared n-gram history. A request under
    another cache_salt sees none of it: it drafts and accepts exactly what the first one did."""
    eng = engine(peaked_model, tiny_tokenizer, True)
    (first,), _ = run(eng, [(prompt, SAMPLED, {})])
    (repeat,), _ = run(eng, [(prompt, SAMPLED, {})])
    (salted,), _ = run(eng, [(prompt, SAMPLED, {"cache_salt": "another tenant"})])
    plain = solo_plain(peaked_model, tiny_tokenizer, prompt, SAMPLED)
    for events in (first, repeat, salted):
        assert_same(events, plain)
    a, b, c = first[-1].stats, repeat[-1].stats, salted[-1].stats
    assert b.accepted_draft_tokens >= a.accepted_draft_tokens + 15 and b.accepted_draft_tokens > 0.8 * b.draft_tokens, (
        a,
        b,
    )
    assert (c.draft_tokens, c.accepted_draft_tokens) == (a.draft_tokens, a.accepted_draft_tokens), (a, c)
    sequence = prompt + tokens(repeat)  # the engine hands a finished request's tail to the history too
    n = eng.config.ngram_history
    assert eng.drafter.history.follow(None, sequence[-n - 1 : -1], 1) == [sequence[-1]]
    off = engine(peaked_model, tiny_tokenizer, True, ngram_history=0)  # the control: without the history
    run(off, [(prompt, SAMPLED, {})])
    (again,), _ = run(off, [(prompt, SAMPLED, {})])
    assert again[-1].stats.accepted_draft_tokens < b.accepted_draft_tokens
    assert_same(again, plain)


def test_blocks_holding_only_rejected_drafts_never_enter_the_prefix_cache(peaked_model, tiny_tokenizer, prompt):
    eng = engine(peaked_model, tiny_tokenizer, True)
    (events,), _ = run(eng, [(prompt, SAMPLED, {})])
    sequence = prompt + tokens(events)
    bs = eng.blocks.block_size
    for block, cached in enumerate(eng.blocks.block_tokens):
        if cached is not None:  # every cached block holds a run of the sequence's own tokens at its place
            i = next(i for i in range(0, len(sequence), bs) if tuple(sequence[i : i + bs]) == cached)
            assert i + bs <= len(sequence), f"block {block} caches tokens past the end of the sequence"


def test_requests_preempted_mid_draft_equal_their_solo_outputs_and_leak_nothing(peaked_model, tiny_tokenizer, prompt):
    params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    prompts = [prompt[i:] + prompt[:i] for i in range(4)]
    eng = engine(peaked_model, tiny_tokenizer, True, num_blocks=12)  # too few blocks for all four at once
    results, _ = run(eng, [(p, params, {}) for p in prompts])
    preempted = [r[-1].stats for r in results if r[-1].stats.preemptions]
    assert preempted and any(s.draft_tokens for s in preempted), "no drafting request was preempted"
    for p, r in zip(prompts, results):
        assert_same(r, solo_plain(peaked_model, tiny_tokenizer, p, params))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    check_block_invariants(eng.blocks)


def test_a_request_cancelled_mid_draft_leaks_no_block(peaked_model, tiny_tokenizer, prompt):
    eng = engine(peaked_model, tiny_tokenizer, True)
    events = []
    rid = eng.submit(prompt, GREEDY, events.append)
    while eng.drafter.stats.num_drafts < 3:
        eng.step()
    eng.abort(rid)
    eng.step()
    assert events[-1].finish_reason == "abort"
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    check_block_invariants(eng.blocks)


def test_a_mixed_batch_gives_each_request_its_plain_output(peaked_model, tiny_tokenizer, prompt):
    requests = [
        (prompt, GREEDY, {}),
        (prompt[3:], SAMPLED, {"speculative": False}),
        (prompt[5:], SAMPLED, {}),
        (prompt[1:], PENALIZED, {}),
        (prompt[2:], GREEDY, {"use_cache": False}),
        (prompt[4:], GREEDY, {"speculative": False}),
    ]
    eng = engine(peaked_model, tiny_tokenizer, True)
    results, _ = run(eng, requests)
    for (ids, params, kw), r in zip(requests, results):
        assert_same(r, solo_plain(peaked_model, tiny_tokenizer, ids, params, **kw))
    drafted = [r[-1].stats.draft_tokens for r in results]
    assert drafted[0] and drafted[2] and drafted[3], "the speculating requests did not draft"
    assert drafted[1] == drafted[4] == drafted[5] == 0, "an opted-out or uncached request drafted"


def test_a_stop_string_inside_an_accepted_draft_ends_where_plain_decoding_ends(peaked_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("the slings and arrows of outrageous fortune, " * 4)
    eng = engine(peaked_model, tiny_tokenizer, True)
    (free,), per_step = run(eng, [(ids, GREEDY, {})])
    # a stop string made of a token that arrives late, in a step that gave several tokens at once
    multi = [i for i, n in enumerate(per_step[0]) if n > 2]
    at = sum(per_step[0][: multi[-1]]) + 1  # the second token of that step: an accepted draft token
    text = tiny_tokenizer.decode(tokens(free)[: at + 1])
    stop_text = next(text[-n:] for n in range(1, len(text) + 1) if text.find(text[-n:]) == len(text) - n)
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True, stop=(stop_text,))
    (spec,), spec_steps = run(engine(peaked_model, tiny_tokenizer, True), [(ids, params, {})])
    plain = solo_plain(peaked_model, tiny_tokenizer, ids, params)
    assert spec[-1].finish_reason == "stop"
    assert_same(spec, plain)
    assert "".join(e.text for e in spec) == "".join(e.text for e in plain)
    assert spec_steps[0][-1] > 1, "the stop string did not fall inside an accepted draft"
    # accepted: generated tokens that were drafts; every step but the last gave one token of its own (the
    # bonus), the last one maybe none (the stop came first); the drafts the stop cut off do not count
    stats, steps = spec[-1].stats, sum(1 for n in spec_steps[0] if n)
    assert stats.generated_tokens - steps <= stats.accepted_draft_tokens <= stats.generated_tokens - steps + 1, stats


def verify_rows_and_single_rows(model, n_tokens: int = 40, k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of K + 1 verify rows in one forward, and of the same positions decoded one at a time."""
    torch.manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (n_tokens + k + 1,)).tolist()
    blocks = list(range(8))
    cache = PagedKVCache(model.config, 8, 16)
    model.forward_step(StepBatch.build([(ids[:n_tokens], 0, blocks)], 16), cache)
    together = model.compute_logits(
        model.forward_step(StepBatch.build([(ids[n_tokens:], n_tokens, blocks)], 16), cache)
    )  # (K + 1, V)
    alone = [
        model.compute_logits(model.forward_step(StepBatch.build([([ids[p]], p, blocks)], 16), cache))
        for p in range(n_tokens, n_tokens + k + 1)
    ]
    return together, torch.cat(alone)


def test_verify_rows_equal_one_row_decodes_bit_for_bit_with_the_exact_kernels(peaked_model):
    together, alone = verify_rows_and_single_rows(peaked_model)
    assert torch.equal(together, alone)


def test_negative_control_torch_stock_kernels_do_not_give_verify_rows_the_same_bits(tiny_tokenizer):
    from model.config import GPTConfig

    config = GPTConfig(vocab_size=tiny_tokenizer.vocab_size, n_positions=128, n_embd=256, n_layer=2, n_head=4)
    together, alone = verify_rows_and_single_rows(random_model(config, kernels_name="stock"))
    assert torch.allclose(together, alone, atol=1e-4), "the stock path is wrong, not merely inexact"
    assert not torch.equal(together, alone), "torch's kernels gave K + 1 rows the bits of one row at a time"


def test_the_server_speculates_on_request_and_reports_accepted_drafts(peaked_model, tiny_tokenizer, tmp_path):
    from model.checkpoint import save_checkpoint
    from tests.server.conftest import serve

    server = serve(
        save_checkpoint(peaked_model, tiny_tokenizer, tmp_path / "peaked"), speculative="ngram", max_num_seqs=4
    )
    try:
        inputs = "the slings and arrows of outrageous fortune, " * 4
        body = {"inputs": inputs, "parameters": {"max_new_tokens": 40, "details": True, "ignore_eos": True}}
        with server.client() as c:
            spec = c.post("/generate", json=body).json()
            plain = c.post(
                "/generate", json={**body, "parameters": {**body["parameters"], "speculative": False}}
            ).json()
            completion = c.post(
                "/v1/completions",
                json={
                    "prompt": inputs,
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                    "cache_salt": "its own",
                },
            ).json()
        assert spec["generated_text"] == plain["generated_text"] == completion["choices"][0]["text"]
        assert [t["logprob"] for t in spec["details"]["tokens"]] == [t["logprob"] for t in plain["details"]["tokens"]]
        assert spec["details"]["accepted_draft_tokens"] > 20 and plain["details"]["accepted_draft_tokens"] == 0
        details = completion["usage"]["completion_tokens_details"]
        # under a salt of its own it cannot draft from the first request's output: it drafts as the first did
        assert details["accepted_prediction_tokens"] == spec["details"]["accepted_draft_tokens"]
        drafted = server.metric("kvserve:spec_decode_num_draft_tokens_total")
        accepted = server.metric("kvserve:spec_decode_num_accepted_tokens_total")
        assert accepted > 0.5 * drafted > 0
        assert server.metric("kvserve:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    finally:
        server.stop()
