"""The engine's side of the richer APIs: prompt logprobs from the prefill itself, scoring without
generating, top logprobs, penalties and logit bias, and copies of one prompt sharing its blocks."""

from __future__ import annotations

import pytest
import torch

from model.config import PromptError
from model.generate import sequence_cache
from model.kv_cache import StepBatch
from model.sampling import SamplingParams
from server.engine import Engine
from tests.conftest import EXACT
from tests.server.conftest import check_block_invariants


def make_engine(model, tokenizer, **kw):
    return Engine(model, tokenizer, threads=1, **{"max_num_seqs": 8, **kw})


def run(eng, ids, params, **kw):
    events = []
    eng.submit(ids, params, events.append, **kw)
    while not events or not events[-1].finished:
        eng.step()
    return events


def direct_log_softmax(model, ids):
    """Every position's log-probabilities, logits - logsumexp, from one forward of the whole prompt: (T, V)."""
    cache, blocks = sequence_cache(model, len(ids))
    hidden = model.forward_step(StepBatch.build([(ids, 0, blocks)], cache.block_size, model.device), cache)
    logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits - logits.logsumexp(-1, keepdim=True), logits.log_softmax(-1), atol=1e-6, rtol=0)
    return logits - logits.logsumexp(-1, keepdim=True)


def prompt(n, seed=0):
    return torch.randint(1, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def same(a, b):
    return a == b if EXACT else abs(a - b) <= 1e-4


def test_prompt_logprobs_equal_a_direct_forwards_log_softmax_in_chunks_too(tiny_model, tiny_tokenizer):
    ids = prompt(50)
    reference = direct_log_softmax(tiny_model, ids)  # (T, V)
    for budget in (128, 7):  # one prefill step, and seven-token chunks
        eng = make_engine(tiny_model, tiny_tokenizer, max_num_batched_tokens=budget)
        events = run(eng, ids, SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=3))
        scored = events[0].prompt_logprobs
        assert [e.position for e in scored] == list(range(1, 50))
        for e in scored:
            assert e.token_id == ids[e.position]
            assert same(e.logprob, reference[e.position - 1, e.token_id].item()), e
            top = reference[e.position - 1].topk(3)
            assert [t for t, _ in e.top] == top.indices.tolist()
        assert events[1].prompt_logprobs is None, "only the first event carries them"


def test_scoring_a_prompt_generates_nothing_and_never_takes_a_prefix_hit(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer)
    ids = prompt(40, 1)
    run(eng, ids, SamplingParams(max_new_tokens=3, temperature=0))  # its blocks are cached now
    events = run(eng, ids, SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    assert len(events) == 1 and events[0].token_id is None and events[0].finish_reason == "length"
    assert events[0].stats.cached_tokens == 0 and len(events[0].prompt_logprobs) == 39
    assert events[0].prompt_logprobs[0].top is None
    check_block_invariants(eng.blocks)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_top_logprobs_of_generated_tokens_are_the_k_best_and_include_the_greedy_pick(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer)
    events = run(eng, prompt(10, 2), SamplingParams(max_new_tokens=6, temperature=0, logprobs=5))
    for e in events:
        assert len(e.top_logprobs) == 5
        assert e.top_logprobs[0][0] == e.token_id and same(e.top_logprobs[0][1], e.logprob)
        assert [lp for _, lp in e.top_logprobs] == sorted((lp for _, lp in e.top_logprobs), reverse=True)


def test_a_logit_bias_of_100_forces_its_token_and_penalties_change_the_text(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer)
    ids = prompt(8, 3)
    forced = run(eng, ids, SamplingParams(max_new_tokens=5, temperature=0, logit_bias=((17, 100.0),)))
    assert [e.token_id for e in forced] == [17] * 5
    plain = [e.token_id for e in run(eng, ids, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))]
    penalised = [
        e.token_id
        for e in run(
            eng,
            ids,
            SamplingParams(
                max_new_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.0
            ),
        )
    ]
    assert plain != penalised and len(set(penalised)) > len(set(plain))


def test_penalized_rows_beside_plain_ones_leave_the_plain_ones_alone(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer)
    ids = prompt(12, 4)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    alone = [e.token_id for e in run(eng, ids, greedy)]
    sinks = [[], []]
    with eng.paused():
        eng.submit(ids, greedy, sinks[0].append)
        eng.submit(
            ids,
            SamplingParams(max_new_tokens=10, temperature=0, frequency_penalty=1.5, logit_bias=((5, 3.0),)),
            sinks[1].append,
            cache_salt="x",
        )
    while not all(s and s[-1].finished for s in sinks):
        eng.step()
    assert [e.token_id for e in sinks[0]] == alone


def test_copies_of_a_prompt_take_its_blocks_from_the_first_copy_and_sample_apart(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer)
    ids = prompt(70, 5)
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed, ignore_eos=True) for seed in (1, 2, 3, 4)]
    sinks = [[] for _ in params]
    eng.submit_copies(ids, params, [s.append for s in sinks])
    while not all(s and s[-1].finished for s in sinks):
        eng.step()
    assert [s[-1].stats.cached_tokens for s in sinks] == [0, 64, 64, 64]
    texts = [tuple(e.token_id for e in s) for s in sinks]
    assert len(set(texts)) == 4, "four seeds, four samples"
    again = [[] for _ in params]
    eng.submit_copies(ids, params, [s.append for s in again])
    while not all(s and s[-1].finished for s in again):
        eng.step()
    assert [tuple(e.token_id for e in s) for s in again] == texts


def test_copies_are_refused_all_together_when_they_cannot_share_the_kv_cache(tiny_model, tiny_tokenizer):
    """10 blocks of 16: a 40-token prompt (3 blocks) with 40 new tokens needs 3 blocks of its own per copy,
    the prompt's last block included, so two copies fit (8 blocks) and three do not (11)."""
    eng = make_engine(tiny_model, tiny_tokenizer, num_blocks=10)
    ids, short, long = prompt(40, 6), SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=40)
    eng.submit_copies(ids, [long, long], [lambda e: None] * 2)
    assert eng.num_waiting == 2
    for params in ([long] * 3, [short, long, short]):  # the longest copy decides, wherever it stands
        with pytest.raises(PromptError, match="3 copies of prompt \\+ max_new_tokens need 11 KV-cache blocks"):
            eng.submit_copies(ids, params, [lambda e: None] * 3)
        assert eng.num_waiting == 2, "a refused set of copies left some queued"
    eng.submit_copies(ids, [short] * 3, [lambda e: None] * 3)  # 3 + 3 * 1 - 1 = 5 blocks
    assert eng.num_waiting == 5
