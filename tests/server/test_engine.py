"""The engine without HTTP: continuous batching, batch-independent greedy output, cancel, limits."""
from __future__ import annotations

import asyncio
import shutil

import pytest

import server.runner
from model.generate import PromptError, generate
from model.sampling import SamplingParams
from server.engine import Engine, QueueFullError

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=32, max_waiting=64).start()
    yield eng
    eng.shutdown()


def prompts(tokenizer, n):
    words = ["To be", "or not", "the question", "世界你好", "Emoji 🤖", "naïve café", "slings and arrows",
             "Whether 'tis nobler in the mind to suffer the slings"]
    return [tokenizer.encode(" ".join(words[(i + j) % len(words)] for j in range(1 + i % 4))) for i in range(n)]


def token_ids(outs):
    return [o.token_id for o in outs if o.token_id is not None]


def run_together(engine, requests):
    """Submits every (prompt, params, use_cache) while the engine is paused, so all share steps."""
    import queue
    sinks = [queue.Queue() for _ in requests]
    with engine.paused():
        for (ids, params, use_cache), q in zip(requests, sinks):
            engine.submit(ids, params, q.put, use_cache=use_cache)
    results = []
    for q in sinks:
        outs = [q.get(timeout=60)]
        while not outs[-1].finished:
            outs.append(q.get(timeout=60))
        results.append(outs)
    return results


def test_greedy_matches_reference_generate(engine, tiny_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("To be, or not to be")
    expected = [s.token_id for s in generate(tiny_model, tiny_tokenizer, ids, GREEDY)]
    assert token_ids(engine.generate(ids, GREEDY, timeout=60)) == expected


def test_greedy_alone_equals_greedy_among_31_others(engine, tiny_tokenizer):
    ps = prompts(tiny_tokenizer, 32)
    alone = [token_ids(engine.generate(p, GREEDY, timeout=60)) for p in ps[:4]]
    others = [(p, SamplingParams(max_new_tokens=5 + i % 9, temperature=0.9, seed=i), i % 3 != 0)
              for i, p in enumerate(ps[4:])]  # sampled, cached and uncached, of different lengths
    together = run_together(engine, [(p, GREEDY, True) for p in ps[:4]] + others)
    for i, outs in enumerate(together[:4]):
        assert token_ids(outs) == alone[i], f"request {i} changed when batched with 31 others"
    assert all(outs[-1].finish_reason in ("length", "eos") for outs in together)


def test_use_cache_false_gives_the_same_greedy_tokens(engine, tiny_tokenizer):
    for p in prompts(tiny_tokenizer, 4):
        cached = token_ids(engine.generate(p, GREEDY, timeout=60))
        uncached = token_ids(engine.generate(p, GREEDY, use_cache=False, timeout=60))
        assert uncached == cached


def test_chunked_prefill_gives_the_same_tokens(engine, tiny_model, tiny_tokenizer):
    chunked = Engine(tiny_model, tiny_tokenizer, max_batch=4, prefill_chunk=3, max_prefill_tokens=5).start()
    try:
        p = tiny_tokenizer.encode("Whether 'tis nobler in the mind to suffer the slings and arrows")
        assert len(p) > 6
        assert token_ids(chunked.generate(p, GREEDY, timeout=60)) == token_ids(engine.generate(p, GREEDY, timeout=60))
    finally:
        chunked.shutdown()


def test_seeded_sampling_is_reproducible_in_any_batch(engine, tiny_tokenizer):
    p = tiny_tokenizer.encode("the question")
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, seed=1234)
    alone = token_ids(engine.generate(p, params, timeout=60))
    together = run_together(engine, [(p, params, True)] + [(q, GREEDY, True) for q in prompts(tiny_tokenizer, 7)])
    assert token_ids(together[0]) == alone


def test_streamed_texts_concatenate_to_the_decoded_tokens(engine, tiny_tokenizer):
    outs = engine.generate(tiny_tokenizer.encode("世界你好 🤖"), SamplingParams(max_new_tokens=30, temperature=0),
                           timeout=60)
    text = "".join(o.text for o in outs)
    ids = [i for i in token_ids(outs) if i not in tiny_tokenizer.special_ids]
    assert text == tiny_tokenizer.decode(ids)
    assert outs[-1].stats.generated_tokens == len(outs)


def test_stop_string_ends_the_request_and_is_not_emitted(engine, tiny_tokenizer):
    p = tiny_tokenizer.encode("To be")
    free_text = "".join(o.text for o in engine.generate(p, SamplingParams(max_new_tokens=30, temperature=0),
                                                        timeout=60))
    stop = free_text[3:5]
    assert stop.strip(), "need a visible stop string from the free run"
    outs = engine.generate(p, SamplingParams(max_new_tokens=30, temperature=0, stop=(stop,)), timeout=60)
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == free_text[: free_text.find(stop)]


def test_cancel_frees_the_slot_within_one_step(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=2)  # not started: the test drives the steps
    events = []
    rid = eng.submit(tiny_tokenizer.encode("To be"), SamplingParams(max_new_tokens=50, temperature=0), events.append)
    eng.step()
    eng.step()
    assert eng.num_running == 1 and eng.cache.num_used == 1
    eng.abort(rid)
    eng.step()
    assert eng.num_running == 0 and eng.cache.num_free == 2
    assert events[-1].finish_reason == "abort" and len(events) == 3


def test_cancel_of_a_waiting_request_removes_it(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=1, max_waiting=2)
    events = []
    eng.submit([1, 2], SamplingParams(max_new_tokens=50, temperature=0), lambda o: None)
    rid = eng.submit([1, 2], SamplingParams(max_new_tokens=5, temperature=0), events.append)
    eng.step()
    assert eng.num_waiting == 1
    eng.abort(rid)
    eng.step()
    assert eng.num_waiting == 0 and [e.finish_reason for e in events] == ["abort"]


def test_queue_limit_refuses_at_once(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=1, max_waiting=1)
    for _ in range(2):
        eng.submit([1, 2], GREEDY, lambda o: None)
    with pytest.raises(QueueFullError, match="max 1"):
        eng.submit([1, 2], GREEDY, lambda o: None)


def test_prompt_beyond_the_context_is_refused(engine):
    with pytest.raises(PromptError, match="exceeds the context of 128"):
        engine.submit([1] * 100, SamplingParams(max_new_tokens=29), lambda o: None)
    with pytest.raises(PromptError, match="empty"):
        engine.submit([], GREEDY, lambda o: None)


def test_a_failing_request_fails_alone(engine, tiny_tokenizer, monkeypatch):
    real_sample = server.runner.sample

    def sample_that_breaks_on_seed_13(logits, params, *args):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("boom")
        return real_sample(logits, params, *args)

    monkeypatch.setattr(server.runner, "sample", sample_that_breaks_on_seed_13)
    ps = prompts(tiny_tokenizer, 4)
    alone = [token_ids(engine.generate(p, GREEDY, timeout=60)) for p in ps]
    bad = (ps[0], SamplingParams(max_new_tokens=5, temperature=1.0, seed=13), True)
    results = run_together(engine, [bad] + [(p, GREEDY, True) for p in ps])
    assert results[0][-1].finish_reason == "error" and "boom" in results[0][-1].error
    assert [token_ids(r) for r in results[1:]] == alone
    assert engine.num_running == 0 and engine.cache.num_used == 0


def test_async_stream_yields_tokens_then_finishes(engine, tiny_tokenizer):
    async def collect():
        return [o async for o in engine.stream(tiny_tokenizer.encode("To be"), GREEDY)]

    outs = asyncio.run(collect())
    assert token_ids(outs) == token_ids(engine.generate(tiny_tokenizer.encode("To be"), GREEDY, timeout=60))
    assert outs[-1].stats.time_to_first_token_s is not None


def test_a_long_prompt_is_read_in_chunks_while_others_keep_decoding(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=2, prefill_chunk=8, max_prefill_tokens=8)
    short, long_ = [], []
    eng.submit(tiny_tokenizer.encode("To be"), SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True),
               short.append)
    eng.step()
    prompt = (tiny_tokenizer.encode("Whether 'tis nobler in the mind to suffer ") * 8)[:60]
    eng.submit(prompt, SamplingParams(max_new_tokens=3, temperature=0), long_.append)
    for step in range(1, 8):
        batch = eng.step()
        assert [(c.start, c.end) for c in batch.prefill] == [(8 * (step - 1), 8 * step)]
        assert len(short) == 1 + step and not long_, "the running request must get a token every step"
    batch = eng.step()
    assert [(c.start, c.end) for c in batch.prefill] == [(56, 60)] and len(long_) == 1 and len(short) == 9


def test_a_slot_left_non_finite_by_a_failed_request_does_not_break_its_next_holder(tiny_model, tiny_tokenizer):
    """A request whose keys came out NaN fails; the short request that reuses its slot, decoding beside a
    longer one (so attention spans the slot's stale columns, masked), must still give its solo tokens."""
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=2)  # not started: the test drives the steps
    long_prompt = (tiny_tokenizer.encode("Whether 'tis nobler in the mind to suffer ") * 4)[:40]
    short_prompt = tiny_tokenizer.encode("To be")
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    solo = [s.token_id for s in generate(tiny_model, tiny_tokenizer, short_prompt, params)]
    broken, beside, short = [], [], []
    eng.submit(long_prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True), broken.append)
    eng.step()
    for layer in eng.cache.layers:  # keys, as an overflowing kernel would leave them
        layer[eng.scheduler.running[0].slot, 0, :, :40] = float("nan")
    eng.submit(long_prompt[:30], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True), beside.append)
    eng.step()
    assert broken[-1].finish_reason == "error", "the request with NaN keys must fail"
    eng.submit(short_prompt, params, short.append)
    while not short or not short[-1].finished:
        eng.step()
    assert short[-1].finish_reason == "length", f"the slot's next holder failed: {short[-1].error}"
    assert token_ids(short) == solo


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile needs a C++ compiler")
def test_compiled_engine_gives_the_eager_engines_tokens(engine, tiny_model, tiny_tokenizer):
    compiled = Engine(tiny_model, tiny_tokenizer, max_batch=8, compile=True).start()
    try:
        compiled.warmup()  # compiles every decode variant first, on free slots it hands back zeroed
        assert compiled.runner.compiled, "the warmup's compile failed, so the engine fell back to eager"
        assert compiled.cache.num_used == 0
        assert all(layer.abs().sum() == 0 for layer in compiled.cache.layers)
        requests = [(p, GREEDY, True) for p in prompts(tiny_tokenizer, 6)]
        assert [token_ids(o) for o in run_together(compiled, requests)] == \
               [token_ids(o) for o in run_together(engine, requests)]
    finally:
        compiled.shutdown()


def test_an_engine_whose_compile_fails_serves_without_it(tiny_model, tiny_tokenizer, monkeypatch, caplog):
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=4, compile=True).start()
    try:
        def no_compiler():
            raise RuntimeError("no C++ compiler found")
        monkeypatch.setattr(eng.runner, "compile_decode_variants", no_compiler)
        eng.warmup()
        assert not eng.runner.compiled
        assert "decoding without it: no C++ compiler found" in caplog.text
        ids = tiny_tokenizer.encode("To be")
        expected = [s.token_id for s in generate(tiny_model, tiny_tokenizer, ids, GREEDY)]
        assert token_ids(eng.generate(ids, GREEDY, timeout=60)) == expected
    finally:
        eng.shutdown()


def test_a_decode_step_whose_compile_fails_later_is_decoded_eagerly(tiny_model, tiny_tokenizer, monkeypatch, caplog):
    eager_decode = server.runner.decode_one_token

    def compile_fails(*args, compiled=False, **kwargs):
        if compiled:
            raise RuntimeError("inductor: an unsupported op")
        return eager_decode(*args, **kwargs)

    monkeypatch.setattr(server.runner, "decode_one_token", compile_fails)
    eng = Engine(tiny_model, tiny_tokenizer, max_batch=4, compile=True).start()  # no warmup: the first step compiles
    try:
        ids = tiny_tokenizer.encode("To be")
        expected = [s.token_id for s in generate(tiny_model, tiny_tokenizer, ids, GREEDY)]
        outs = eng.generate(ids, GREEDY, timeout=60)
        assert token_ids(outs) == expected and outs[-1].finish_reason == "length"
        assert not eng.runner.compiled
        assert "decoding without it: inductor: an unsupported op" in caplog.text
    finally:
        eng.shutdown()
