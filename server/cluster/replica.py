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
import dataclasses
import os
from collections.abc import AsyncIterator

from ray import serve

from server.cluster.protocol import Submission
from server.cluster.router import report_from
from server.engine import AsyncSink, Engine, EngineArgs, TokenOutput


class EngineReplica:
    def __init__(self, engine_args: EngineArgs, warmup: bool = True) -> None:
        self.engine = Engine.from_args(engine_args).start()
        if warmup:
            self.engine.warmup()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, sub: Submission) -> AsyncIterator[list[TokenOutput]]:
        """An empty batch once the engine took the prompt, then the events of every copy, in batches,
        until each copy has its last one. A refusal (prompt too long, queue full, shutting down) is the
        stream's exception, before any batch."""
        events: asyncio.Queue = asyncio.Queue()
        sink = AsyncSink(asyncio.get_running_loop(), events)
        if len(sub.params) == 1:
            ids = [self.engine.submit(sub.prompt_ids, sub.params[0], sink, use_cache=sub.use_cache,
                                      request_id=sub.request_ids[0], cache_salt=sub.cache_salt,
                                      speculative=sub.speculative)]
        else:
            ids = self.engine.submit_copies(sub.prompt_ids, sub.params, [sink] * len(sub.params),
                                            use_cache=sub.use_cache, cache_salt=sub.cache_salt,
                                            speculative=sub.speculative)
        rename = dict(zip(ids, sub.request_ids))
        open_ids = set(ids)
        try:
            yield []  # taken
            while open_ids:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                for out in batch:
                    if out.finished:
                        open_ids.discard(out.request_id)
                if len(sub.params) > 1:
                    batch = [dataclasses.replace(out, request_id=rename[out.request_id]) for out in batch]
                yield batch
        finally:  # the ingress cancelled the stream (client gone, timeout) or it ended
            for rid in open_ids:
                self.engine.abort(rid)

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
