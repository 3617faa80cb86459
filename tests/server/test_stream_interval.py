"""`--stream-interval-ms`: the engine wakes an event loop at most once per interval, except for a request's
first and last events, a step with prompt work, and an engine going idle (server/engine/sinks.py)."""

import asyncio
import time

import pytest

from model.sampling import SamplingParams
from server.engine import AsyncSink, Engine, TokenOutput
from server.engine.sinks import LoopHandover
from tests.server.conftest import count_wakeups

LONG_MS = 600_000.0  # an interval no test outlasts: only the exceptions hand events over
GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)


class RecordingLoop:
    """A real event loop that is never run: what the engine hands it is recorded, in order."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups: list[list[TokenOutput]] = []
        self.loop.call_soon_threadsafe = self._record

    def _record(self, callback, items):
        self.wakeups.append([out for _, out in items])

    def sink(self) -> AsyncSink:
        return AsyncSink(self.loop, asyncio.Queue())

    def close(self) -> None:
        self.loop.close()


@pytest.fixture()
def recording():
    rec = RecordingLoop()
    yield rec
    rec.close()


def test_held_events_go_with_a_requests_first_or_last_event_or_before_a_step_with_prompt_work(
    tiny_model, tiny_tokenizer, recording
):
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=4, threads=1, stream_interval_ms=LONG_MS)  # stepped here
    a = tiny_tokenizer.encode("To be, or not")
    eng.submit(a, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True), recording.sink(), request_id="a")
    eng.step()  # a's prompt: its first token goes at once
    assert [[o.request_id for o in w] for w in recording.wakeups] == [["a"]]
    eng.step()
    eng.step()  # two decode steps: held
    assert len(recording.wakeups) == 1 and eng.handover.holding
    eng.submit(
        tiny_tokenizer.encode("the question"),
        SamplingParams(max_new_tokens=2, temperature=0),
        recording.sink(),
        request_id="b",
    )
    eng.step()  # b's prompt: a's two held tokens go before it runs, then b's first with a's next
    assert [[o.request_id for o in w] for w in recording.wakeups] == [["a"], ["a", "a"], ["a", "b"]]
    while eng.scheduler.has_work():
        eng.step()
    events = [o for w in recording.wakeups for o in w]
    assert not eng.handover.holding
    a_events = [o for o in events if o.request_id == "a"]
    assert len([o for o in a_events if o.token_id is not None]) == 8 and a_events[-1].finished  # nothing lost
    assert sum(o.finished for o in events) == 2  # every request's last event went at once


def test_with_an_interval_the_loop_is_woken_a_few_times_instead_of_every_step_and_the_tokens_are_unchanged(
    tiny_model, tiny_tokenizer
):
    prompts = [tiny_tokenizer.encode(t) for t in ("To be", "or not to be", "that is", "the question")]

    def run(interval_ms: float) -> tuple[list[list[int]], int]:
        eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=8, threads=1, stream_interval_ms=interval_ms).start()

        async def main():
            loop = asyncio.get_running_loop()
            wakeups = count_wakeups(loop)
            queues = [asyncio.Queue() for _ in prompts]
            with eng.paused():  # every request in the same steps
                for ids, q in zip(prompts, queues):
                    eng.submit(ids, GREEDY, AsyncSink(loop, q))
            tokens = []
            for q in queues:
                outs = [await q.get()]
                while not outs[-1].finished:
                    outs.append(await q.get())
                tokens.append([o.token_id for o in outs if o.token_id is not None])
            return tokens, len(wakeups)

        try:
            return asyncio.run(main())
        finally:
            eng.shutdown()

    every_step, woken_every_step = run(0.0)
    paced, woken_paced = run(LONG_MS)
    assert paced == every_step and all(len(t) == GREEDY.max_new_tokens for t in paced)
    assert woken_every_step >= GREEDY.max_new_tokens  # a wake-up per step
    assert woken_paced <= 3  # the first tokens' step, the last tokens' step (and one spare for a split prompt step)


def test_each_requests_first_event_goes_at_once_when_requests_share_a_sink(tiny_model, tiny_tokenizer, recording):
    """As the copies of one prompt (n > 1) do, and the prompts of one request."""
    eng = Engine(tiny_model, tiny_tokenizer, max_num_seqs=4, threads=1, stream_interval_ms=LONG_MS)  # stepped here
    shared = recording.sink()
    eng.submit(tiny_tokenizer.encode("To be, or not"), GREEDY, shared, request_id="a")
    eng.step()
    eng.step()  # a's second token: held
    eng.submit(tiny_tokenizer.encode("the question"), GREEDY, shared, request_id="b")
    eng.step()  # a's held token goes before b's prompt; b's first token, on the same sink, goes at once
    assert [[(o.request_id, o.index) for o in w] for w in recording.wakeups] == [
        [("a", 1)],
        [("a", 2)],
        [("a", 3), ("b", 1)],
    ]


def test_what_is_held_goes_on_flush_and_when_the_engine_has_nothing_left_to_step(tiny_model, tiny_tokenizer, recording):
    first, then = (TokenOutput(rid, 1, 7, "a", 0.0, False, None) for rid in ("x", "y"))

    def hold_two(handover: LoopHandover) -> None:  # `first` wakes the loop; `then` waits out the interval
        with handover.step():
            handover.hold(recording.loop, asyncio.Queue(), first, urgent=True)
        with handover.step():
            handover.hold(recording.loop, asyncio.Queue(), then, urgent=False)

    handover = LoopHandover(LONG_MS / 1000)
    hold_two(handover)
    assert recording.wakeups == [[first]] and handover.holding
    handover.flush()
    assert recording.wakeups == [[first], [then]] and not handover.holding

    eng = Engine(tiny_model, tiny_tokenizer, threads=1, stream_interval_ms=LONG_MS).start()
    try:  # the same on the engine thread, then no step to carry `then`: the idle engine hands it over
        eng.run_between_steps(lambda: hold_two(eng.handover)).result(timeout=30)
        deadline = time.monotonic() + 30
        while len(recording.wakeups) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert recording.wakeups == [[first], [then]] * 2
    finally:
        eng.shutdown()


def test_a_negative_interval_is_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="stream_interval_ms"):
        Engine(tiny_model, tiny_tokenizer, threads=1, stream_interval_ms=-1)
