"""The engine without HTTP: continuous batching over one flattened forward per step, batch-independent
output, chunked prompts under the token budget, cancellation, limits, faults and shutdown."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
import torch

import server.engine.model_runner as model_runner
import server.engine.sampler as sampler
from model.config import PromptError
from model.generate import generate
from model.sampling import SamplingParams
from server.engine import AsyncSink, Engine, EngineStoppedError, QueueFullError, TokenOutput
from tests.conftest import EXACT, random_model
from tests.server.conftest import check_block_invariants, count_wakeups

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=32, max_waiting=64, threads=1).start()
    yield eng
    eng.shutdown()


class RequestStream:
    """Async iterator over one request's TokenOutputs, fed from the engine thread through an AsyncSink."""

    def __init__(self, events: asyncio.Queue) -> None:
        self._events, self.done = events, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenOutput:
        if self.done:
            raise StopAsyncIteration
        out = await self._events.get()
        self.done = out.finished
        return out


def stream(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
    """Submits from the running asyncio loop; the events cross over in one batch per step."""
    events: asyncio.Queue = asyncio.Queue()
    engine.submit(prompt_ids, params, AsyncSink(asyncio.get_running_loop(), events))
    return RequestStream(events)


def prompts(tokenizer, n):
    words = [
        "To be",
        "or not",
        "the question",
        "世界你好",
        "Emoji 🤖",
        "naïve café",
        "slings and arrows",
        "Whether 'tis nobler in the mind to suffer the slings",
    ]
    return [tokenizer.encode(" ".join(words[(i + j) % len(words)] for j in range(1 + i % 4))) for i in range(n)]


def token_ids(outs):
    return [o.token_id for o in outs if o.token_id is not None]


def logprobs(outs):
    return [o.logprob for o in outs if o.token_id is not None]


def run_together(engine, requests):
    """Submits every (prompt, params, use_cache) while the engine is paused, so all share steps."""
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


def drive(eng, *sinks):
    """Steps a stopped engine until every sink has its last event."""
    while not all(s and s[-1].finished for s in sinks):
        eng.step()


def test_greedy_matches_reference_generate(engine, tiny_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("To be, or not to be")
    expected = [s.token_id for s in generate(tiny_model, tiny_tokenizer, ids, GREEDY)]
    assert token_ids(engine.generate(ids, GREEDY, timeout=60)) == expected


def test_greedy_alone_equals_greedy_among_31_others(engine, tiny_tokenizer):
    ps = prompts(tiny_tokenizer, 32)
    alone = [engine.generate(p, GREEDY, timeout=60, cache_salt="alone") for p in ps[:4]]
    others = [
        (p, SamplingParams(max_new_tokens=5 + i % 9, temperature=0.9, seed=i), i % 3 != 0) for i, p in enumerate(ps[4:])
    ]  # sampled, cached and uncached, of different lengths
    together = run_together(engine, [(p, GREEDY, True) for p in ps[:4]] + others)
    for i, outs in enumerate(together[:4]):
        assert token_ids(outs) == token_ids(alone[i]), f"request {i} changed when batched with 31 others"
        if EXACT:
            assert logprobs(outs) == logprobs(alone[i]), f"request {i}: logprobs changed in the batch"
    assert all(outs[-1].finish_reason in ("length", "eos") for outs in together)


def test_use_cache_false_gives_the_same_tokens_and_logprobs(engine, tiny_tokenizer):
    for p in prompts(tiny_tokenizer, 4):
        cached = engine.generate(p, GREEDY, timeout=60)
        uncached = engine.generate(p, GREEDY, use_cache=False, timeout=60)
        assert token_ids(uncached) == token_ids(cached)
        if EXACT:
            assert logprobs(uncached) == logprobs(cached)


@pytest.mark.skipif(not EXACT, reason="an int8 KV cache is read by the exact kernels only")
def test_an_int8_kv_cache_gives_the_same_bits_alone_batched_uncached_and_on_a_prefix_hit(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=16, threads=1, kv_cache_dtype="int8").start()
    try:
        assert eng.cache.dtype == torch.int8
        ps = prompts(tiny_tokenizer, 12)
        long = [t for p in ps for t in p][:45]  # whole blocks of it are shared by the second request
        alone = [eng.generate(p, GREEDY, timeout=60) for p in (long, *ps[:3])]
        hit = eng.generate(long, GREEDY, timeout=60)
        assert hit[-1].stats.cached_tokens >= 32
        uncached = [eng.generate(p, GREEDY, use_cache=False, timeout=60) for p in (long, *ps[:3])]
        together = run_together(eng, [(p, GREEDY, True) for p in (long, *ps[:3])] + [(p, GREEDY, True) for p in ps[3:]])
        for runs in ([hit], uncached, together[:4]):
            for outs, ref in zip(runs, alone):
                assert token_ids(outs) == token_ids(ref) and logprobs(outs) == logprobs(ref)
    finally:
        eng.shutdown()


def test_an_int8_kv_cache_on_torchs_kernels_is_refused_naming_the_flag(tiny_config, tiny_tokenizer):
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        Engine(random_model(tiny_config), tiny_tokenizer, kernels="stock", kv_cache_dtype="int8")


@pytest.mark.skipif(not EXACT, reason="an int8 KV cache is read by the exact kernels only")
def test_an_int8_kv_cache_refuses_blocks_longer_than_its_kernels_take(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="--block-size 512"):
        Engine(tiny_model, tiny_tokenizer, kv_cache_dtype="int8", block_size=512)


def test_a_small_token_budget_reads_prompts_in_chunks_with_the_same_tokens(engine, tiny_model, tiny_tokenizer):
    chunked = Engine(tiny_model, tiny_tokenizer, max_num_seqs=4, max_num_batched_tokens=5, threads=1).start()
    try:
        p = tiny_tokenizer.encode("Whether 'tis nobler in the mind to suffer the slings and arrows")
        assert len(p) > 6
        assert token_ids(chunked.generate(p, GREEDY, timeout=60)) == token_ids(engine.generate(p, GREEDY, timeout=60))
    finally:
        chunked.shutdown()


def test_seeded_sampling_is_reproducible_in_any_batch(engine, tiny_tokenizer):
    p = tiny_tokenizer.encode("the question")
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, seed=1234)
    alone = engine.generate(p, params, timeout=60)
    together = run_together(engine, [(p, params, True)] + [(q, GREEDY, True) for q in prompts(tiny_tokenizer, 7)])
    assert token_ids(together[0]) == token_ids(alone)


def test_streamed_texts_concatenate_to_the_decoded_tokens(engine, tiny_tokenizer):
    outs = engine.generate(
        tiny_tokenizer.encode("世界你好 🤖"), SamplingParams(max_new_tokens=30, temperature=0), timeout=60
    )
    text = "".join(o.text for o in outs)
    ids = [i for i in token_ids(outs) if i not in tiny_tokenizer.special_ids]
    assert text == tiny_tokenizer.decode(ids)
    assert outs[-1].stats.generated_tokens == len(outs)


def test_stop_string_ends_the_request_and_is_not_emitted(engine, tiny_tokenizer):
    p = tiny_tokenizer.encode("To be")
    free_text = "".join(
        o.text for o in engine.generate(p, SamplingParams(max_new_tokens=30, temperature=0), timeout=60)
    )
    stop = free_text[3:5]
    assert stop.strip(), "need a visible stop string from the free run"
    outs = engine.generate(p, SamplingParams(max_new_tokens=30, temperature=0, stop=(stop,)), timeout=60)
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == free_text[: free_text.find(stop)]


def test_cancel_frees_the_blocks_within_one_step(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=2, num_blocks=16, threads=1)  # not started
    events = []
    rid = eng.submit(tiny_tokenizer.encode("To be"), SamplingParams(max_new_tokens=50, temperature=0), events.append)
    eng.step()
    eng.step()
    assert eng.num_running == 1 and eng.blocks.num_free_blocks < 16
    eng.abort(rid)
    eng.step()
    assert eng.num_running == 0 and eng.blocks.num_free_blocks == 16
    assert events[-1].finish_reason == "abort" and len(events) == 3
    check_block_invariants(eng.blocks)


def test_cancel_of_a_waiting_request_removes_it(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=1, max_waiting=2, threads=1)
    events = []
    eng.submit([1, 2], SamplingParams(max_new_tokens=50, temperature=0), lambda o: None)
    rid = eng.submit([1, 2], SamplingParams(max_new_tokens=5, temperature=0), events.append)
    eng.step()
    assert eng.num_waiting == 1
    eng.abort(rid)
    eng.step()
    assert eng.num_waiting == 0 and [e.finish_reason for e in events] == ["abort"]


def test_queue_limit_refuses_at_once(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=1, max_waiting=1, threads=1)
    for _ in range(2):  # one for the free running place, one waiting
        eng.submit([1, 2], GREEDY, lambda o: None)
    with pytest.raises(QueueFullError, match="max 1"):
        eng.submit([1, 2], GREEDY, lambda o: None)


def test_a_cancelled_request_gives_its_place_at_once_not_at_the_next_step(tiny_model, tiny_tokenizer):
    """Ray Serve sends a replica its next request as soon as a cancelled call there ends: the engine has not
    stepped yet, and the cancelled request must not make it refuse (a 429 behind a queue with room)."""
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=1, max_waiting=1, threads=1)
    running = eng.submit([1, 2], SamplingParams(max_new_tokens=50, temperature=0), lambda o: None)
    eng.step()
    waiting = eng.submit([1, 2], GREEDY, lambda o: None)
    eng.abort(waiting)  # not carried out until the next step
    eng.submit([1, 2], GREEDY, lambda o: None)
    with pytest.raises(QueueFullError, match="max 1"):  # the places of those not cancelled still count
        eng.submit([1, 2], GREEDY, lambda o: None)
    eng.abort(running)
    eng.submit([1, 2], GREEDY, lambda o: None)
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 1


def test_prompt_beyond_the_context_or_the_cache_is_refused(engine, tiny_model, tiny_tokenizer):
    with pytest.raises(PromptError, match="exceeds the context of 128"):
        engine.submit([1] * 100, SamplingParams(max_new_tokens=29), lambda o: None)
    with pytest.raises(PromptError, match="empty"):
        engine.submit([], GREEDY, lambda o: None)
    with pytest.raises(ValueError, match="fewer than one 128-token sequence needs"):
        Engine(tiny_model, tiny_tokenizer, num_blocks=4)


def test_a_failing_request_fails_alone(engine, tiny_tokenizer, monkeypatch):
    real_sample = sampler.sample

    def sample_that_breaks_on_temperature_0_5(logits, batch, *args):
        if (batch.temperature == 0.5).any():
            raise RuntimeError("boom")
        return real_sample(logits, batch, *args)

    monkeypatch.setattr(sampler, "sample", sample_that_breaks_on_temperature_0_5)
    ps = prompts(tiny_tokenizer, 4)
    alone = [token_ids(engine.generate(p, GREEDY, timeout=60)) for p in ps]
    bad = (ps[0], SamplingParams(max_new_tokens=5, temperature=0.5, seed=13), True)
    results = run_together(engine, [bad] + [(p, GREEDY, True) for p in ps])
    assert results[0][-1].finish_reason == "error" and "boom" in results[0][-1].error
    assert [token_ids(r) for r in results[1:]] == alone
    assert engine.num_running == 0 and engine.kv_cache_usage == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=99),
        SamplingParams(max_new_tokens=12, temperature=0, frequency_penalty=1.5),
    ],
    ids=["seeded", "penalized"],
)
def test_a_batch_rerun_one_by_one_samples_what_the_batch_would_have(engine, tiny_tokenizer, monkeypatch, params):
    """After a failed batched step, each request is run alone; a seeded request's output must not change
    (with per-request random generators, the rerun would draw again from advanced ones), nor a penalized
    one's (the failed run had already added its pick to the request's history)."""
    p = tiny_tokenizer.encode("the question")
    alone = token_ids(engine.generate(p, params, timeout=60))
    real_execute, calls = model_runner.ModelRunner.run, []

    def execute_failing_once_batched(self, sched):
        calls.append(len(sched.num_tokens))
        if len(sched.num_tokens) > 1 and calls.count(2) == 3:
            real_execute(self, sched)  # runs (and samples) once, then fails as a late error would
            raise RuntimeError("a batched step failed")
        return real_execute(self, sched)

    monkeypatch.setattr(model_runner.ModelRunner, "run", execute_failing_once_batched)
    other = (prompts(tiny_tokenizer, 2)[1], SamplingParams(max_new_tokens=8, temperature=0), True)
    results = run_together(engine, [(p, params, True), other])
    assert calls.count(2) >= 3, "the batched step never failed"
    assert token_ids(results[0]) == alone


def test_async_stream_yields_tokens_then_finishes(engine, tiny_tokenizer):
    async def collect():
        return [o async for o in stream(engine, tiny_tokenizer.encode("To be"), GREEDY)]

    outs = asyncio.run(collect())
    assert token_ids(outs) == token_ids(engine.generate(tiny_tokenizer.encode("To be"), GREEDY, timeout=60))
    assert outs[-1].stats.time_to_first_token_s is not None


def test_the_event_loop_gets_one_wakeup_per_step_for_all_its_streams(engine, tiny_tokenizer):
    async def run():
        wakeups = count_wakeups(asyncio.get_running_loop())
        params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
        with engine.paused():
            streams = [stream(engine, p, params) for p in prompts(tiny_tokenizer, 8)]
        outs = await asyncio.gather(*[collect(s) for s in streams])
        return wakeups, outs

    async def collect(stream):
        return [o async for o in stream]

    wakeups, outs = asyncio.run(run())
    assert sum(len(o) for o in outs) == 8 * 20
    assert len(wakeups) <= 20 + 2, f"{len(wakeups)} wake-ups for 20 steps of 8 streams"


def test_decode_rows_keep_going_while_a_long_prompt_is_read_in_chunks(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=2, max_num_batched_tokens=21, threads=1)
    short, long_ = [], []
    eng.submit(
        tiny_tokenizer.encode("To be"), SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True), short.append
    )
    eng.step()
    prompt = (tiny_tokenizer.encode("Whether 'tis nobler in the mind to suffer ") * 8)[:60]
    eng.submit(prompt, SamplingParams(max_new_tokens=3, temperature=0), long_.append)
    for step in range(1, 4):
        sched = eng.step()
        counts = sorted(sched.num_tokens.values())
        assert counts == [1, 20], f"step {step}: {counts}"  # the decode row, then 20 prompt tokens of the budget
        assert len(short) == 1 + step, "the running request must get a token every step"
        assert len(long_) == (1 if step == 3 else 0)
    assert sorted(eng.step().num_tokens.values()) == [1, 1] and len(long_) == 2


def test_prompts_progress_even_when_decode_rows_take_the_whole_budget(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=4, max_num_batched_tokens=2, threads=1)
    for _ in range(3):
        eng.submit(
            tiny_tokenizer.encode("To be"),
            SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True),
            lambda o: None,
        )
    while eng.num_waiting:
        eng.step()
    late = []
    eng.submit(list(range(1, 41)), SamplingParams(max_new_tokens=2, temperature=0), late.append)
    sched = eng.step()
    assert sorted(sched.num_tokens.values()) == [1, 1, 1, 16]  # at least MIN_PROMPT_TOKENS of prompt
    while not late or not late[-1].finished:
        eng.step()


def test_blocks_left_non_finite_by_a_failed_request_never_reach_the_next_holder(tiny_model, tiny_tokenizer):
    """A request whose keys came out NaN fails; its blocks leave the prefix cache and are zeroed, so the
    requests that take them next (and share their prefix) still give their solo tokens."""
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=2, num_blocks=16, threads=1)
    long_prompt = (tiny_tokenizer.encode("Whether 'tis nobler in the mind to suffer ") * 4)[:40]
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    solo = [s.token_id for s in generate(tiny_model, tiny_tokenizer, long_prompt, params)]
    broken = []
    eng.submit(long_prompt, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True), broken.append)
    eng.step()  # the prompt is read (and its full blocks cached)
    blocks = list(eng.scheduler.running[0].block_ids)
    for layer in eng.cache.layers:  # keys, as an overflowing kernel would leave them
        layer[blocks] = float("nan")
    drive(eng, broken)
    assert broken[-1].finish_reason == "error", "the request with NaN keys must fail"
    again = []
    eng.submit(long_prompt, params, again.append)
    drive(eng, again)
    assert again[-1].finish_reason == "length", f"the blocks' next holder failed: {again[-1].error}"
    assert token_ids(again) == solo and again[-1].stats.cached_tokens == 0
    check_block_invariants(eng.blocks)


def _engine_held_mid_step(tiny_model, tiny_tokenizer, monkeypatch):
    """A started 16-block engine whose one request is stopped inside a step (after its second token) until
    `release` is set. Returns (engine, the request's events, release)."""
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=2, num_blocks=16, threads=1).start()
    in_step, release = threading.Event(), threading.Event()
    real_execute = eng.runner.run

    def slow_execute(sched):
        if eng.scheduler.running and eng.scheduler.running[0].num_output_tokens >= 2:
            in_step.set()
            release.wait(30)
        return real_execute(sched)

    monkeypatch.setattr(eng.runner, "run", slow_execute)
    events = queue.Queue()
    eng.submit(
        tiny_tokenizer.encode("To be"), SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True), events.put
    )
    assert in_step.wait(30)
    return eng, events, release


def _last_event_after_release(eng: Engine, events: queue.Queue, release: threading.Event) -> TokenOutput:
    release.set()
    eng._thread.join(30)
    outs = []
    while not events.empty():
        outs.append(events.get())
    return outs[-1]


def test_shutdown_never_frees_state_under_a_running_step(tiny_model, tiny_tokenizer, monkeypatch):
    eng, events, release = _engine_held_mid_step(tiny_model, tiny_tokenizer, monkeypatch)
    held = 16 - eng.blocks.num_free_blocks
    eng.shutdown(timeout=0.2)  # returns while the step is still running
    assert eng.blocks.num_free_blocks == 16 - held, "shutdown freed blocks under a running step"
    assert eng.num_running == 1
    last = _last_event_after_release(eng, events, release)
    assert last.finish_reason == "error" and last.error_type == "shutdown"
    assert eng.blocks.num_free_blocks == 16 and eng.num_running == 0


def test_a_between_steps_call_cancelled_by_its_caller_does_not_stop_the_shutdown(
    tiny_model, tiny_tokenizer, monkeypatch
):
    """GET /kv's call, cancelled when its client leaves, while a shutdown waits for the step it is behind: the
    engine still ends its requests with a shutdown event, fails the calls still waiting, and frees every block."""
    eng, events, release = _engine_held_mid_step(tiny_model, tiny_tokenizer, monkeypatch)
    cancelled, waiting = eng.run_between_steps(lambda: 1), eng.run_between_steps(lambda: 2)
    assert cancelled.cancel()
    eng.shutdown(timeout=0.2)
    last = _last_event_after_release(eng, events, release)
    assert last.finish_reason == "error" and last.error_type == "shutdown"
    assert isinstance(waiting.exception(timeout=5), EngineStoppedError)
    assert eng.blocks.num_free_blocks == 16 and eng.num_running == 0
