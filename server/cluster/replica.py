"""One engine replica as a Ray Serve deployment class: its own model copy, block pool and prefix cache.

`generate` first answers an empty batch, once the engine has taken the prompt (a refusal, such as a
full queue, is the stream's exception instead, before any item, so the ingress can answer it as an HTTP
status), then streams the prompt's events back in batches: everything that arrived since the last
batch, which is one engine step's events or more, so a request's tokens cross Ray at most once a step.
`record_routing_stats` is Ray Serve's hook for routing state: Serve polls it and hands the result to the
request router (`ray_router.py`) as the replica's `routing_stats`.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from ray import serve

from server.cluster.protocol import FeedRequest, Submission, Taken
from server.cluster.router import report_from
from server.engine import AsyncSink, Engine, EngineArgs, QueueFullError, TokenOutput

FEED_IDLE_S = 2.0  # a feed with no request open for this long ends (so that Serve can stop the replica)
ENGINE_ROOM_POLL_S = 0.01  # how often a call in the feed's place looks for room in the engine


class Feed(asyncio.Queue):
    """An ingress's events on this replica, and the `generate` calls waiting for their requests' last event."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: dict[str, asyncio.Event] = {}  # request id -> set once its last event is queued
        self.readers = 0  # `feed` calls attached to it

    def put_nowait(self, out: TokenOutput) -> None:
        super().put_nowait(out)
        if out.finished:
            done = self.waiting.pop(out.request_id, None)
            if done is not None:
                done.set()


class EngineReplica:
    def __init__(self, engine_args: EngineArgs, warmup: bool = True) -> None:
        self.engine = Engine.from_args(engine_args).start()
        if warmup:
            self.engine.warmup()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._feeds: dict[str, Feed] = {}  # ingress id -> the events of its requests here

    async def generate(self, sub: Submission) -> AsyncIterator[list[TokenOutput] | Taken]:
        """With `sub.feed` (what the ingress sends) and that ingress's feed attached here: `Taken(on_feed)`
        once the engine took the prompt, then nothing until every copy has its last event, which the feed
        carries. Otherwise a first item once taken (`Taken`, or [] without `sub.feed`), then the events of
        every copy in batches on this call. A refusal (prompt too long, queue full, shutting down) is the
        stream's exception, before any item."""
        feed = self._feeds.get(sub.feed) if sub.feed is not None else None
        if feed is None or not feed.readers:
            taken = [] if sub.feed is None else Taken(self.replica_id, on_feed=False)
            async for batch in self._generate_here(sub, taken):
                yield batch
            return
        finished = {rid: asyncio.Event() for rid in sub.request_ids}
        feed.waiting.update(finished)
        try:
            self._submit(sub, feed)
        except BaseException:
            for rid in sub.request_ids:
                feed.waiting.pop(rid, None)
            raise
        try:
            yield Taken(self.replica_id, on_feed=True)
            for done in finished.values():
                await done.wait()
        finally:  # the ingress cancelled the call (client gone, timeout) or it ended
            for rid, done in finished.items():
                if not done.is_set():
                    feed.waiting.pop(rid, None)
                    self.engine.abort(rid)
            if not feed.readers and not feed.waiting and self._feeds.get(sub.feed) is feed:
                del self._feeds[sub.feed]  # its feed is gone: nothing will read what is left

    async def feed(self, req: FeedRequest) -> AsyncIterator[list[TokenOutput]]:
        """The events of every request the ingress `req.ingress_id` sent here, one item per engine step (or
        more steps, when the ingress reads slower): an empty item once open, and the end once no request
        of that ingress has been open here for FEED_IDLE_S (the ingress opens it again when it needs it)."""
        feed = self._feeds.setdefault(req.ingress_id, Feed())
        feed.readers += 1
        try:
            yield []
            while True:
                try:  # while a request is open its last event will come: no timer then
                    batch = [await (feed.get() if feed.waiting else asyncio.wait_for(feed.get(), FEED_IDLE_S))]
                except asyncio.TimeoutError:
                    if not feed.waiting and feed.empty():
                        return
                    continue
                while not feed.empty():
                    batch.append(feed.get_nowait())
                yield batch
        finally:  # idle, or cancelled (the ingress closed it, or is gone): forgotten once nothing waits on it
            feed.readers -= 1
            if not feed.readers and not feed.waiting and self._feeds.get(req.ingress_id) is feed:
                del self._feeds[req.ingress_id]

    async def _generate_here(self, sub: Submission, taken: list | Taken) -> AsyncIterator[list[TokenOutput] | Taken]:
        events: asyncio.Queue = asyncio.Queue()
        while True:
            try:
                self._submit(sub, events)
                break
            except QueueFullError:
                # Serve counts one place more than the engine holds, for the ingress's feed; a call that
                # took it while no feed did waits here for room, as it would have in Serve's queue (until
                # the ingress cancels it at its deadline). Copies were never counted one place each: refused
                if sub.feed is None or len(sub.params) > 1:
                    raise
                await asyncio.sleep(ENGINE_ROOM_POLL_S)
        open_ids = set(sub.request_ids)
        try:
            yield taken
            while open_ids:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                for out in batch:
                    if out.finished:
                        open_ids.discard(out.request_id)
                yield batch
        finally:  # the ingress cancelled the stream (client gone, timeout) or it ended
            for rid in open_ids:
                self.engine.abort(rid)

    def _submit(self, sub: Submission, events: asyncio.Queue) -> None:
        sink = AsyncSink(asyncio.get_running_loop(), events)
        if len(sub.params) == 1:
            self.engine.submit(sub.prompt_ids, sub.params[0], sink, use_cache=sub.use_cache,
                               request_id=sub.request_ids[0], cache_salt=sub.cache_salt, speculative=sub.speculative)
        else:
            self.engine.submit_copies(sub.prompt_ids, sub.params, [sink] * len(sub.params), use_cache=sub.use_cache,
                                      cache_salt=sub.cache_salt, speculative=sub.speculative,
                                      request_ids=sub.request_ids)

    # async, so Serve calls them on the replica's loop: a sync method runs in a new worker thread each time
    async def record_routing_stats(self) -> dict:
        stats = self.engine.stats
        return report_from(self.replica_id, self.engine.blocks, self.engine.num_running, self.engine.num_waiting,
                           prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
                           preemptions=stats.preemptions, kv_cache_usage=self.engine.kv_cache_usage,
                           pid=os.getpid(), kernels=self.engine.model.kernels).to_stats()

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted."""
        if not self.engine.alive:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5)
