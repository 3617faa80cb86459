"""The paged KV cache in the engine: prefix-cache hits give what misses and `use_cache: false` give
(bit for bit with the exact kernels), preemption never changes an output, a mixed step gives each
request what it gets alone, and cancellations at random points leak no block."""

from __future__ import annotations

import random

import pytest
import torch

from model.sampling import SamplingParams
from server.engine import Engine
from server.engine.sampler import Sampler
from tests.conftest import EXACT
from tests.server.conftest import check_block_invariants

GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture
def recorded(monkeypatch):
    """Every logits row the runner samples from, by request id: {id: [(V,) tensors, one per step]}."""
    rows: dict[str, list[torch.Tensor]] = {}
    real = Sampler.pick

    def pick(self, logits, args):
        for req, row in zip(args.requests, logits):
            rows.setdefault(req.request_id, []).append(row.clone())
        return real(self, logits, args)

    monkeypatch.setattr(Sampler, "pick", pick)
    return rows


def make_engine(tiny_model, tiny_tokenizer, **kw):
    return Engine(tiny_model, tiny_tokenizer, threads=1, **{"max_num_seqs": 8, **kw})


def run(eng, ids, params=GREEDY, **kw):
    """Submits one request to a stopped engine and steps it to the end: (events, request id)."""
    events = []
    rid = eng.submit(ids, params, events.append, **kw)
    while not events or not events[-1].finished:
        eng.step()
    return events, rid


def same_logits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    check = torch.equal if EXACT else (lambda x, y: torch.allclose(x, y, atol=1e-4, rtol=0))
    return all(check(x, y) for x, y in zip(a, b))


def tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def prompt(n: int, seed: int = 0, vocab: int = 380) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_full_hit_after_the_writer_finished_equals_a_miss_and_use_cache_false(tiny_model, tiny_tokenizer, recorded):
    eng = make_engine(tiny_model, tiny_tokenizer)
    p = prompt(70)
    miss, miss_id = run(eng, p)
    hit, hit_id = run(eng, p)
    uncached, uncached_id = run(eng, p, use_cache=False)
    assert miss[-1].stats.cached_tokens == 0
    assert hit[-1].stats.cached_tokens == 64  # 4 full blocks; the block of the last token is computed
    assert uncached[-1].stats.cached_tokens == 0
    assert tokens(hit) == tokens(miss) == tokens(uncached)
    assert same_logits(recorded[hit_id], recorded[miss_id]) and same_logits(recorded[uncached_id], recorded[miss_id])
    assert eng.stats.prefix_cache_hits == 64 and eng.stats.prefix_cache_queries == 140


@pytest.mark.parametrize("shared, hit", [(31, 16), (32, 32), (33, 32)])
def test_partial_hits_either_side_of_a_block_boundary_equal_misses(tiny_model, tiny_tokenizer, recorded, shared, hit):
    eng = make_engine(tiny_model, tiny_tokenizer)
    base = prompt(80)
    run(eng, base)
    p = base[:shared] + prompt(50 - shared, seed=shared + 1)
    got, got_id = run(eng, p)
    reference, reference_id = run(eng, p, cache_salt="isolated")  # no hit: another salt
    assert got[-1].stats.cached_tokens == hit and reference[-1].stats.cached_tokens == 0
    assert tokens(got) == tokens(reference) and same_logits(recorded[got_id], recorded[reference_id])


def test_a_hit_while_the_writer_is_still_running(tiny_model, tiny_tokenizer, recorded):
    eng = make_engine(tiny_model, tiny_tokenizer)
    p = prompt(60, seed=3)
    writer = []
    writer_id = eng.submit(p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True), writer.append)
    eng.step()  # its prompt is read and its full blocks are cached
    assert eng.num_running == 1
    reader = []
    reader_id = eng.submit(p, GREEDY, reader.append)
    while not reader or not reader[-1].finished:
        eng.step()
    assert not writer[-1].finished, "the writer should still be running"
    assert reader[-1].stats.cached_tokens == 48
    alone, alone_id = run(make_engine(tiny_model, tiny_tokenizer), p)
    assert tokens(reader) == tokens(alone) and same_logits(recorded[reader_id], recorded[alone_id])
    assert tokens(writer)[:10] == tokens(alone)
    assert writer_id != reader_id


def test_eviction_under_memory_pressure_then_a_miss(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer, num_blocks=10)
    p = prompt(60, seed=4)
    first, _ = run(eng, p)
    for i in range(3):  # unrelated requests take every block, evicting p's cached ones
        run(eng, prompt(100, seed=10 + i), SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    again, _ = run(eng, p)
    assert again[-1].stats.cached_tokens == 0 and tokens(again) == tokens(first)
    check_block_invariants(eng.blocks)


def test_prefix_caching_off_never_hits(tiny_model, tiny_tokenizer):
    eng = make_engine(tiny_model, tiny_tokenizer, enable_prefix_caching=False)
    p = prompt(70)
    run(eng, p)
    again, _ = run(eng, p)
    assert again[-1].stats.cached_tokens == 0 and eng.stats.prefix_cache_hits == 0


def test_preemption_never_changes_an_output(tiny_model, tiny_tokenizer):
    """Four requests that need 20 blocks at the end share 10: the newest are preempted, recompute when
    they resume, and still end with what each gives alone, greedy and seeded alike."""
    reqs = [
        (
            prompt(20, seed=i),
            SamplingParams(max_new_tokens=60, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True),
        )
        for i in range(4)
    ]
    alone = [tokens(run(make_engine(tiny_model, tiny_tokenizer), p, params)[0]) for p, params in reqs]
    eng = make_engine(tiny_model, tiny_tokenizer, num_blocks=10)
    sinks = [[] for _ in reqs]
    for (p, params), sink in zip(reqs, sinks):
        eng.submit(p, params, sink.append)
    while not all(s and s[-1].finished for s in sinks):
        eng.step()
    assert eng.stats.preemptions > 0, "the cache was large enough: nothing was preempted"
    assert [tokens(s) for s in sinks] == alone
    assert all(s[-1].finish_reason == "length" for s in sinks)
    assert sum(s[-1].stats.preemptions for s in sinks) == eng.stats.preemptions
    check_block_invariants(eng.blocks)
    assert eng.blocks.num_free_blocks == 10


def test_a_mixed_step_gives_each_request_what_it_gets_alone(tiny_model, tiny_tokenizer, recorded):
    eng = make_engine(tiny_model, tiny_tokenizer, max_num_batched_tokens=64)
    decoding, chunked, uncached = prompt(10, 5), prompt(70, 6), prompt(30, 7)
    alone = {}
    for name, p, kw in (("decode", decoding, {}), ("chunk", chunked, {}), ("uncached", uncached, {"use_cache": False})):
        events, rid = run(make_engine(tiny_model, tiny_tokenizer), p, **kw)
        alone[name] = (tokens(events), recorded[rid])
    sinks = {name: [] for name in alone}
    ids = {"decode": eng.submit(decoding, GREEDY, sinks["decode"].append)}
    eng.step()  # the first request is decoding now
    ids["uncached"] = eng.submit(uncached, GREEDY, sinks["uncached"].append, use_cache=False)
    ids["chunk"] = eng.submit(chunked, GREEDY, sinks["chunk"].append)  # gets what the budget has left
    kinds = set()
    while not all(s and s[-1].finished for s in sinks.values()):
        sched = eng.step()
        counts = {r.request_id: n for r, n in sched.num_tokens.items()}
        if counts.get(ids["decode"]) == 1 and 1 < counts.get(ids["chunk"], 0) < 70 and ids["uncached"] in counts:
            kinds.add("all three")
    assert kinds, "no step held a decode row, a prompt chunk and an uncached recompute together"
    for name in alone:
        assert tokens(sinks[name]) == alone[name][0], name
        assert same_logits(recorded[ids[name]], alone[name][1]), name


def test_a_soak_with_cancellations_at_random_points_leaks_no_block(tiny_model, tiny_tokenizer):
    rng = random.Random(0)
    eng = make_engine(tiny_model, tiny_tokenizer, num_blocks=24, max_num_seqs=6, max_waiting=200)
    live: list[str] = []
    for step in range(300):
        if rng.random() < 0.5 and eng.num_waiting < 20:
            n = rng.randrange(1, 90)
            p = prompt(n, seed=rng.randrange(6)) if rng.random() < 0.5 else prompt(n, seed=100 + step)
            params = SamplingParams(
                max_new_tokens=rng.randrange(1, 128 - n), temperature=rng.choice([0, 0.9]), seed=step
            )
            live.append(eng.submit(p, params, lambda o: None, use_cache=rng.random() < 0.85))
        if live and rng.random() < 0.2:
            eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()
        check_block_invariants(eng.blocks)
    for rid in live:
        eng.abort(rid)
    while eng.scheduler.has_work():
        eng.step()
    check_block_invariants(eng.blocks)
    assert eng.blocks.num_free_blocks == 24 and all(n == 0 for n in eng.blocks.ref_counts)
    assert eng.stats.preemptions > 0 and eng.stats.prefix_cache_hits > 0, "the soak never reached those paths"
