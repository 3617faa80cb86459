"""The replicas' feeds, each end on its own: the replica's class over a real engine (without Ray's
transport: its generators are driven here as Serve drives them), and the ingress's bookkeeping over
streams this test writes, in the orders Ray may deliver them (a feed's events before the call's
`Taken`, a feed ending first, an attempt given up). The whole path runs in test_cluster.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("ray.serve")

from model.sampling import SamplingParams  # noqa: E402
from server.cluster.feeds import FEED_ENDED, Feeds, Followed  # noqa: E402
from server.cluster.protocol import FeedRequest, Submission, Taken  # noqa: E402
from server.cluster.replica import EngineReplica  # noqa: E402
from server.engine import Engine, TokenOutput  # noqa: E402

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture()
def replica(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer, max_num_seqs=8, threads=1).start()
    rep = object.__new__(EngineReplica)  # as Serve makes it, less the model's loading
    rep.engine, rep.replica_id, rep._feeds, rep._calls = engine, "r0", {}, 0
    yield rep
    engine.shutdown()


def _sub(rid: str, ingress: str | None, tokens: int = 6) -> Submission:
    return Submission(
        [rid], PROMPT, [SamplingParams(max_new_tokens=tokens, temperature=0)], True, None, ingress_id=ingress
    )


async def _drain(stream, into: list) -> None:
    async for item in stream:
        into.append(item)


def _tokens(events: list[TokenOutput], rid: str) -> list[int]:
    return [e.token_id for e in events if e.request_id == rid and e.token_id is not None]


def test_a_replica_sends_requests_taken_while_its_feed_is_attached_on_the_feed_and_others_on_their_calls(replica):
    async def scenario():
        feed = replica.feed(FeedRequest("ing", "r0", "f1"))
        assert await feed.__anext__() == []  # attached
        on_feed: list = []
        reader = asyncio.create_task(_drain(feed, on_feed))
        on_call_a, on_call_a2, on_call_b = [], [], []
        with replica.engine.paused():  # taken together: they share every step
            calls = [
                asyncio.create_task(_drain(replica.generate(sub), into))
                for sub, into in (
                    (_sub("a", "ing"), on_call_a),
                    (_sub("a2", "ing"), on_call_a2),
                    (_sub("b", "other"), on_call_b),
                )
            ]
            await asyncio.sleep(0.05)
        await asyncio.gather(*calls)
        await asyncio.sleep(0.05)
        reader.cancel()
        return on_feed, on_call_a, on_call_a2, on_call_b

    on_feed, on_call_a, on_call_a2, on_call_b = asyncio.run(scenario())
    assert on_call_a == on_call_a2 == [Taken("r0", "f1")]  # their calls only say where; the events came on the feed
    assert on_call_b[0] == Taken("r0", None)  # no feed of that ingress here: on the call
    on_feed_events = [e for batch in on_feed for e in batch]
    events_b = [e for batch in on_call_b[1:] for e in batch]
    assert events_b[-1].finished and [e.finished for e in on_feed_events].count(True) == 2
    assert _tokens(on_feed_events, "a") == _tokens(on_feed_events, "a2") == _tokens(events_b, "b")
    assert len(_tokens(events_b, "b")) == 6
    assert all({e.request_id for e in batch} == {"a", "a2"} for batch in on_feed)  # a step's events, one item


def test_a_feed_that_ends_before_its_requests_fails_their_calls_and_the_engine_aborts_them(replica):
    """Replaced by a newer feed of its ingress, or cancelled: either way nothing reads it, so the requests
    on it are aborted and their calls fail (the ingress ends them with an error)."""

    async def scenario(end_it) -> list:
        feed = replica.feed(FeedRequest("ing", "r0", "f1"))
        await feed.__anext__()
        reader = asyncio.create_task(_drain(feed, []))
        call = replica.generate(_sub("long", "ing", tokens=100))
        with replica.engine.paused():  # the request cannot finish before its feed ends
            assert await call.__anext__() == Taken("r0", "f1")
            waiting = asyncio.create_task(call.__anext__())
            await asyncio.sleep(0.01)
            newer = await end_it(feed, reader)
            with pytest.raises(RuntimeError, match="feed"):
                await waiting
        await asyncio.sleep(0.2)  # the engine's next step takes the abort
        assert reader.done() and replica.engine.num_running == 0
        if newer is not None:  # the newer feed carries the next request
            after = replica.generate(_sub("next", "ing"))
            assert await after.__anext__() == Taken("r0", "f2")
            await after.aclose()
            await newer.aclose()
        return list(replica._feeds)

    async def replaced(feed, reader):
        newer = replica.feed(FeedRequest("ing", "r0", "f2"))
        assert await newer.__anext__() == []
        return newer

    async def cancelled(feed, reader):
        reader.cancel()
        return None

    assert asyncio.run(scenario(replaced)) == []
    assert asyncio.run(scenario(cancelled)) == []


def test_a_replica_refuses_a_feed_for_another_and_closes_one_its_ingress_names_as_broken(replica):
    """Serve sends a feed whose replica is gone to any other, which refuses it; a call naming its
    ingress's feed among the broken ones (the ingress lost it, the replica had not noticed) closes it here
    and carries its own events."""

    async def scenario():
        with pytest.raises(ValueError, match="reached r0"):
            await replica.feed(FeedRequest("ing", "r7", "f0")).__anext__()
        feed = replica.feed(FeedRequest("ing", "r0", "f1"))
        await feed.__anext__()
        reader = asyncio.create_task(_drain(feed, []))
        items: list = []
        await _drain(replica.generate(dataclasses.replace(_sub("a", "ing"), dead_feeds=("f1",))), items)
        await asyncio.sleep(0.01)
        return items, reader.done(), dict(replica._feeds)

    items, reader_done, feeds = asyncio.run(scenario())
    assert items[0] == Taken("r0", None) and items[-1][-1].finished and reader_done and feeds == {}


class _Stream:
    """One call's stream as a Ray Serve handle returns it, written by the test."""

    def __init__(self, request) -> None:
        self.request, self.items, self.cancelled = request, asyncio.Queue(), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    def __init__(self) -> None:
        self.calls: list[_Stream] = []

    def options(self, **kw):
        return self

    def remote(self, request):
        self.calls.append(_Stream(request))
        return self.calls[-1]


def _event(rid: str, index: int, last: bool = False) -> TokenOutput:
    return TokenOutput(rid, index, 10 + index, "x", 0.0, False, "length" if last else None)


async def _followed_on_an_attached_feed():
    """One call's request ("q") expected, and the feed to replica r0 opened and attached: (handle, feeds,
    followed, the request's events, the feed's stream)."""
    handle, got = _Handle(), []
    feeds = Feeds(handle, "ing")
    followed = Followed({"q": got.append}, {"q"}, asyncio.get_running_loop().create_future())
    feeds.expect(followed)
    feeds.open("r0")
    await asyncio.sleep(0)
    stream = handle.calls[0]
    stream.items.put_nowait([])  # attached
    return handle, feeds, followed, got, stream


def test_the_ingress_holds_a_feeds_events_until_the_calls_taken_and_drops_an_abandoned_attempts():
    async def scenario():
        handle, feeds, followed, got, stream = await _followed_on_an_attached_feed()
        feed_id = stream.request.feed_id
        stream.items.put_nowait([_event("q", 1)])  # before the call's Taken
        await asyncio.sleep(0.01)
        assert got == []
        feeds.taken(followed, Taken("r0", feed_id))
        assert [e.index for e in got] == [1]
        feeds.unfollow(followed)  # given up (a replica fault before it started) and sent again
        followed.attempt = 1
        feeds.expect(followed)
        stream.items.put_nowait([_event("q", 2), _event("q~1", 1)])  # the old attempt's, then the new one's
        feeds.taken(followed, Taken("r0", feed_id))
        await asyncio.sleep(0.01)
        stream.items.put_nowait([_event("q~1", 2, last=True)])
        await asyncio.sleep(0.01)
        return got, followed.closed.done()

    got, closed = asyncio.run(scenario())
    assert [(e.request_id, e.index) for e in got] == [("q", 1), ("q", 1), ("q", 2)] and got[-1].finished
    assert closed


def test_a_feed_ending_first_ends_its_requests_with_an_error_also_one_whose_taken_comes_later():
    async def scenario():
        handle, riding, late = _Handle(), [], []
        feeds = Feeds(handle, "ing")
        loop = asyncio.get_running_loop()
        one = Followed({"one": riding.append}, {"one"}, loop.create_future())
        two = Followed({"two": late.append}, {"two"}, loop.create_future())
        feeds.expect(one)
        feeds.expect(two)
        feeds.open("r0")
        await asyncio.sleep(0)
        stream = handle.calls[0]
        stream.items.put_nowait([])
        feeds.taken(one, Taken("r0", stream.request.feed_id))
        stream.items.put_nowait([_event("one", 1), _event("two", 1)])
        stream.items.put_nowait(ConnectionError("stream broke"))
        await asyncio.sleep(0.01)
        feeds.taken(two, Taken("r0", stream.request.feed_id))  # its Taken came after the feed ended
        feeds.open("r0")  # too soon after a failure: no new feed yet
        await asyncio.sleep(0)
        return riding, late, len(handle.calls)

    riding, late, calls = asyncio.run(scenario())
    assert [e.index for e in riding] == [1, 0] and riding[-1].finish_reason == "error"
    assert "stream broke" in riding[-1].error
    assert [e.index for e in late] == [1, 0] and late[-1].finish_reason == "error"
    assert calls == 1


def test_a_feed_ending_before_any_event_of_a_request_on_it_leaves_the_request_to_be_sent_again():
    async def scenario():
        handle, feeds, followed, got, stream = await _followed_on_an_attached_feed()
        feeds.taken(followed, Taken("r0", stream.request.feed_id))
        stream.items.put_nowait(StopAsyncIteration())  # ended, its events never came
        await asyncio.sleep(0.01)
        feeds.open("r0")  # an ended feed's replica gets a new one at once
        await asyncio.sleep(0)
        return got, followed, len(handle.calls)

    got, followed, calls = asyncio.run(scenario())
    assert got == [] and followed.lost == (FEED_ENDED, "generation") and followed.closed.done()
    assert followed.open_ids == {"q"}
    assert calls == 2


class _Handles:
    """A Serve handle per method, as `handle.options(method_name=...)` gives them."""

    def __init__(self) -> None:
        self.by_method: dict[str, _Handle] = {}

    def options(self, method_name: str, **kw):
        return self.by_method.setdefault(method_name, _Handle())


async def _retried_after_its_feed_broke(checkpoint, got: list):
    """A call the replica took onto its feed, whose feed broke before any of its events came: (the client,
    its broken feed, the retry's call)."""
    from server.cluster.client import RayEngineClient
    from server.engine import EngineArgs

    handles = _Handles()
    client = RayEngineClient(handles, EngineArgs(checkpoint=checkpoint), lambda: None, asyncio.get_running_loop())
    params = SamplingParams(max_new_tokens=2, temperature=0)
    first = client.submit(PROMPT, params, lambda out: None, request_id="first")
    await asyncio.sleep(0)
    call = handles.by_method["generate"].calls[0]
    call.items.put_nowait(Taken("r0", None))  # no feed there yet: the ingress opens one
    call.items.put_nowait([_event(first, 1, last=True)])
    call.items.put_nowait(StopAsyncIteration())
    await asyncio.sleep(0.01)
    (feed,) = handles.by_method["feed"].calls
    feed.items.put_nowait([])  # attached
    client.submit(PROMPT, params, got.append, request_id="second")
    await asyncio.sleep(0)
    call = handles.by_method["generate"].calls[1]
    call.items.put_nowait(Taken("r0", feed.request.feed_id))
    await asyncio.sleep(0.01)
    feed.items.put_nowait(ConnectionError("stream broke"))
    await asyncio.sleep(0.01)
    assert call.cancelled and got == []
    for _ in range(100):  # the retry's backoff
        await asyncio.sleep(0.02)
        if len(handles.by_method["generate"].calls) == 3:
            break
    return client, feed, handles.by_method["generate"].calls[2]


def test_a_call_whose_feed_broke_before_its_first_event_is_sent_again_naming_the_broken_feed(tiny_checkpoint):
    """The replica took the call onto its feed, and the feed broke before any of its events came: the call
    is sent again with request ids of its own and names the broken feed (a replica still holding it closes
    it); the second attempt's events reach the request under its own id."""

    async def scenario():
        got = []
        client, feed, again = await _retried_after_its_feed_broke(tiny_checkpoint, got)
        again.items.put_nowait(Taken("r0", None))
        again.items.put_nowait([_event("second~1", 1), _event("second~1", 2, last=True)])
        again.items.put_nowait(StopAsyncIteration())
        await client.admitted(["second"])
        await asyncio.sleep(0.01)
        return again.request, feed.request.feed_id, got

    request, broken, got = asyncio.run(scenario())
    assert request.request_ids == ["second~1"] and request.dead_feeds == (broken,)
    assert [(e.request_id, e.index) for e in got] == [("second", 1), ("second", 2)] and got[-1].finished


def test_a_retry_refused_for_a_full_serve_queue_ends_its_request_as_overloaded_not_as_failed(tiny_checkpoint):
    """The first attempt was taken, so the request is answered already: Serve's full queue refusing the retry
    ends it with an 'overloaded' error (a 429 for a request not streamed), as the engine's full queue would."""
    from ray.serve.exceptions import BackPressureError

    async def scenario():
        got = []
        _, _, again = await _retried_after_its_feed_broke(tiny_checkpoint, got)
        again.items.put_nowait(BackPressureError(num_queued_requests=4, max_queued_requests=4))
        await asyncio.sleep(0.05)
        return got

    (last,) = asyncio.run(scenario())
    assert last.finished and (last.finish_reason, last.error_type) == ("error", "overloaded"), last


def test_a_replicas_hold_off_after_a_failed_feed_is_forgotten_once_past(monkeypatch):
    """A replica whose feed failed gets no new one for FEED_RETRY_S; after that nothing of it is kept (with
    autoscaling, replicas come and go for as long as the ingress lives)."""
    monkeypatch.setattr("server.cluster.feeds.FEED_RETRY_S", 0.01)

    async def scenario():
        handle = _Handle()
        feeds = Feeds(handle, "ing")
        for replica in ("r0", "r1"):
            feeds.open(replica)
            await asyncio.sleep(0)
            handle.calls[-1].items.put_nowait(ConnectionError("replica gone"))
            await asyncio.sleep(0.03)
        return set(feeds._not_before)

    assert asyncio.run(scenario()) == {"r1"}
