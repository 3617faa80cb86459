"""One engine replica as a Ray Serve deployment class: its own model copy, block pool and prefix cache.

`generate` takes one prompt (and its copies). A refusal (prompt too long, queue full, shutting down) is
the call's exception, before any item, so the ingress can answer it as an HTTP status. Once the engine
took the prompt, the call's first item says so: `Taken` (or [] for a caller that names no ingress).
Where the caller's ingress has its feed attached here (`feed`: one stream for all of that ingress's
requests on this replica), the events go on the feed and the call ends once each copy's last event is
queued there; otherwise they come on the call itself. Either stream carries, per item, everything that
arrived since its last item: one engine step's events or more, so a request's tokens cross Ray at most
once a step, and on the feed a step of many requests is one item.

A request's events ride exactly one stream, chosen here when it is taken and named in `Taken`. A feed
that ends for any reason other than idleness (the ingress cancelled it or opened another, the
connection broke) aborts the requests still on it, and their calls fail; the ingress ends them with an
error, as it does when it sees the feed end. So no event is lost unnoticed.
`record_routing_stats` is Ray Serve's hook for routing state: Serve polls it and hands the result to the
request router (`ray_router.py`) as the replica's `routing_stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator

from ray import serve

from server.cluster.protocol import FeedEnded, FeedRequest, Submission, Taken
from server.cluster.router import report_from
from server.engine import AsyncSink, Engine, EngineArgs, QueueFullError, TokenOutput

FEED_IDLE_S = 2.0  # a feed with no request on it for this long ends (so that Serve can stop the replica)
ENGINE_ROOM_POLL_S = 0.01  # how often a call in the feed's place looks for room in the engine


class Feed(asyncio.Queue):
    """One ingress's events on this replica, and the calls waiting for their requests' last event."""

    def __init__(self, ingress_id: str, feed_id: str) -> None:
        super().__init__()
        self.ingress_id, self.feed_id = ingress_id, feed_id
        self.waiting: dict[str, asyncio.Event] = {}  # request id -> set once its last event is queued
        self.cut: set[str] = set()  # requests aborted because the feed ended before they did
        self.closed = False

    def put_nowait(self, out: TokenOutput | None) -> None:
        if self.closed:  # nothing reads it; its requests were aborted as it closed
            return
        super().put_nowait(out)
        if out is not None and out.finished:
            done = self.waiting.pop(out.request_id, None)
            if done is not None:
                done.set()


class Renamed:
    """A queue's view that gives each event its ingress's request id (copies get the engine's own)."""

    def __init__(self, events: asyncio.Queue, names: dict[str, str]) -> None:
        self.events, self.names = events, names

    def put_nowait(self, out: TokenOutput) -> None:
        self.events.put_nowait(dataclasses.replace(out, request_id=self.names[out.request_id]))


class EngineReplica:
    def __init__(self, engine_args: EngineArgs, warmup: bool = True) -> None:
        self.engine = Engine.from_args(engine_args).start()
        if warmup:
            self.engine.warmup()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._feeds: dict[str, Feed] = {}  # ingress id -> its attached feed
        self._calls = 0  # `generate` calls here (Serve's count of this replica's requests, less the feeds)

    async def generate(self, sub: Submission) -> AsyncIterator[list[TokenOutput] | Taken]:
        """`Taken` (or [] without `sub.ingress_id`) once the engine took the prompt; then, on that
        ingress's feed if it is attached here, nothing until each copy's last event is queued there (an
        exception if the feed ended first), else the copies' events in batches on this call."""
        self._calls += 1
        try:
            async with contextlib.aclosing(self._generate(sub)) as items:  # its aborts run as this one ends
                async for item in items:
                    yield item
        finally:
            self._calls -= 1

    async def _generate(self, sub: Submission) -> AsyncIterator[list[TokenOutput] | Taken]:
        feed = self._feeds.get(sub.ingress_id) if sub.ingress_id is not None else None
        if feed is not None and feed.feed_id in sub.dead_feeds:  # the ingress lost it; the replica had not noticed
            self._close(feed)
            feed = None
        if feed is None:
            taken = [] if sub.ingress_id is None else Taken(self.replica_id, None)
            async with contextlib.aclosing(self._generate_here(sub, taken)) as batches:
                async for batch in batches:
                    yield batch
            return
        finished = {rid: asyncio.Event() for rid in sub.request_ids}
        feed.waiting.update(finished)
        try:
            engine_ids = self._submit(sub, feed)
        except BaseException:
            for rid in sub.request_ids:
                feed.waiting.pop(rid, None)
            raise
        try:
            yield Taken(self.replica_id, feed.feed_id)
            for done in finished.values():
                await done.wait()
            if feed.cut.intersection(finished):  # aborted below
                raise FeedEnded("the feed carrying this request's events ended before the request did")
        finally:  # the ingress cancelled the call (client gone, timeout), or it ended
            for rid, done in finished.items():
                if not done.is_set() or rid in feed.cut:
                    feed.waiting.pop(rid, None)
                    self.engine.abort(engine_ids[rid])
            feed.cut.difference_update(finished)

    async def feed(self, req: FeedRequest) -> AsyncIterator[list[TokenOutput]]:
        """The events of every request that ingress `req.ingress_id` sent here while this feed was
        attached, an item per engine step (or more steps, when the ingress reads slower): an empty item
        once attached, and the end once no request has been on it for FEED_IDLE_S. A newer feed of the
        same ingress replaces it. A feed meant for another replica (Serve sends one there when its own is
        gone) is refused."""
        if req.replica_id != self.replica_id:
            raise ValueError(f"a feed for replica {req.replica_id} reached {self.replica_id}")
        older = self._feeds.get(req.ingress_id)
        if older is not None:  # the ingress no longer reads it
            self._close(older)
        feed = self._feeds[req.ingress_id] = Feed(req.ingress_id, req.feed_id)
        try:
            yield []
            while not feed.closed:
                try:  # while a request is on it its last event will come: no timer then
                    first = await (feed.get() if feed.waiting else asyncio.wait_for(feed.get(), FEED_IDLE_S))
                except asyncio.TimeoutError:
                    if not feed.waiting and feed.empty():
                        return
                    continue
                batch = [out for out in _with_queued(first, feed) if out is not None]  # None: woken to close
                if batch:
                    yield batch
        finally:  # idle, replaced, or cancelled (the ingress closed it, or is gone)
            self._close(feed)

    def _close(self, feed: Feed) -> None:
        """No event goes on `feed` any more: the requests still on it are aborted and their calls fail."""
        if feed.closed:
            return
        if self._feeds.get(feed.ingress_id) is feed:
            del self._feeds[feed.ingress_id]
        feed.cut.update(feed.waiting)
        for done in feed.waiting.values():  # each call aborts its requests as it fails
            done.set()
        feed.waiting.clear()
        feed.put_nowait(None)  # wakes its stream, if it waits
        feed.closed = True

    async def _generate_here(self, sub: Submission, taken: list | Taken) -> AsyncIterator[list[TokenOutput] | Taken]:
        events: asyncio.Queue = asyncio.Queue()
        while True:
            try:
                engine_ids = self._submit(sub, events)
                break
            except QueueFullError:
                # Serve counts one place more than the engine holds, for the ingress's feed; a call that
                # took it while no feed did waits here for room, as it would have in Serve's queue (until
                # the ingress cancels it at its deadline). Refused otherwise (the engine is full of copies,
                # which count one Serve place for several engine places)
                if sub.ingress_id is None or len(sub.params) > 1 or self._calls <= self._engine_places:
                    raise
                await asyncio.sleep(ENGINE_ROOM_POLL_S)
        open_ids = set(sub.request_ids)
        try:
            yield taken
            while open_ids:
                batch = _with_queued(await events.get(), events)
                for out in batch:
                    if out.finished:
                        open_ids.discard(out.request_id)
                yield batch
        finally:  # the ingress cancelled the stream (client gone, timeout) or it ended
            for rid in open_ids:
                self.engine.abort(engine_ids[rid])

    def _submit(self, sub: Submission, events: asyncio.Queue | Feed) -> dict[str, str]:
        """Into the engine, each event to `events` under the ingress's request id. Returns the engine's id
        of each of the ingress's."""
        loop = asyncio.get_running_loop()
        if len(sub.params) == 1:
            self.engine.submit(
                sub.prompt_ids,
                sub.params[0],
                AsyncSink(loop, events),
                use_cache=sub.use_cache,
                request_id=sub.request_ids[0],
                cache_salt=sub.cache_salt,
                speculative=sub.speculative,
            )
            return {sub.request_ids[0]: sub.request_ids[0]}
        names: dict[str, str] = {}
        sink = AsyncSink(loop, Renamed(events, names))
        ids = self.engine.submit_copies(
            sub.prompt_ids,
            sub.params,
            [sink] * len(sub.params),
            use_cache=sub.use_cache,
            cache_salt=sub.cache_salt,
            speculative=sub.speculative,
        )
        names.update(zip(ids, sub.request_ids))  # before any event: they reach the loop after this returns
        return dict(zip(sub.request_ids, ids))

    @property
    def _engine_places(self) -> int:
        """Requests the engine holds, running and waiting: Serve's places here, less the feed's."""
        return self.engine.config.max_num_seqs + self.engine.config.max_waiting

    # async, so Serve calls them on the replica's loop: a sync method runs in a new worker thread each time
    async def record_routing_stats(self) -> dict:
        return report_from(
            self.replica_id,
            self.engine.blocks,
            self.engine.num_running,
            self.engine.num_waiting,
            counters=self.engine.counters(),
            kv_cache_usage=self.engine.kv_cache_usage,
            pid=os.getpid(),
            kernels=self.engine.model.kernels,
            step_stats=self.engine.step_stats_snapshot(),
        ).to_stats()

    async def drain(self, grace: float) -> None:
        """The cluster's shutdown, which the ingress broadcasts to every replica before Serve stops them: the
        engine takes no new request, and those in flight get `grace` seconds, then end with an error event
        of type 'shutdown' on their stream, as `python -m server` ends them."""
        await asyncio.to_thread(self.engine.drain, grace)

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted."""
        if not self.engine.alive:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5)


def _with_queued(first, queue: asyncio.Queue) -> list:
    """`first`, then whatever else `queue` holds now: one stream item."""
    batch = [first]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch
