"""The KV-cache view over HTTP: `GET /kv` answers one snapshot of the block pool as JSON
(`server.engine.kv_view.KVSnapshot`), `GET /kv/stream` sends snapshots as Server-Sent Events while
someone listens. Both need the API key when the server has one (the middleware guards every route
but /health and the page).

What watching costs: a snapshot is taken on the engine thread between two steps, only when asked.
However many pages watch, one loop per app takes at most one snapshot every KV_STREAM_PERIOD seconds and
sends it only when it changed; each watcher's queue holds one snapshot (a slow reader gets the newest,
never a backlog). With no watcher the loop is not running and the engine does nothing for the view.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server.api.engine_client import EngineClient, NotInProcessError
from server.api.errors import APIError
from server.api.openapi_responses import EVENT_STREAM, EventStreamResponse, json_events
from server.api.sse import SSE_HEADERS
from server.engine import EngineStoppedError
from server.engine.kv_view import KVSnapshot

KV_STREAM_PERIOD = 0.1  # seconds between two snapshots while someone watches: the view's bound on the engine
KV_STREAM_MAX_S = 600.0  # a stream ends after this long (the page reconnects): no watcher holds up a shutdown
KEEP_ALIVE_S = 15.0  # a comment line when nothing changed for this long, so proxies keep the stream open

router = APIRouter()


NOT_IN_PROCESS = (
    "the KV-cache view needs the engine in this process (python -m server), not behind the cluster's ingress"
)


def _check_in_process(engine: EngineClient) -> None:
    """Refuses a view before it starts (a stream's status comes before its first snapshot)."""
    if not engine.info.in_process:
        raise APIError(422, NOT_IN_PROCESS, "validation")


async def take_snapshot(engine: EngineClient) -> KVSnapshot:
    """One snapshot, taken between two steps; 422 behind the cluster's ingress, 503 once the engine has stopped."""
    try:
        return await engine.kv_snapshot()
    except NotInProcessError as e:
        raise APIError(422, NOT_IN_PROCESS, "validation") from e
    except EngineStoppedError as e:
        raise APIError(503, "the server is shutting down", "unavailable") from e


class KVWatch:
    """The one snapshot loop of an app, shared by all its watchers; it runs only while there is one."""

    def __init__(self, engine: EngineClient, is_shutting_down: Callable[[], bool]) -> None:
        self.engine, self.is_shutting_down = engine, is_shutting_down
        self._queues: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self._last: str | None = None  # the last snapshot sent, as JSON

    def subscribe(self) -> asyncio.Queue:
        """A queue of snapshots (JSON text), None at the end. Its first item is the current snapshot."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._queues.add(queue)
        if self._last is not None:  # the loop runs: the newest snapshot now, the next change when it comes
            queue.put_nowait(self._last)
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    async def _run(self) -> None:
        try:
            while self._queues and not self.is_shutting_down():
                try:
                    snapshot = await take_snapshot(self.engine)
                except APIError:
                    break  # the engine stopped
                data = json.dumps(dataclasses.asdict(snapshot), separators=(",", ":"))
                if data != self._last:
                    self._last = data
                    for queue in self._queues:
                        self._replace(queue, data)
                await asyncio.sleep(KV_STREAM_PERIOD)
        finally:
            for queue in self._queues:
                self._replace(queue, None)
            self._queues.clear()
            self._task, self._last = None, None

    @staticmethod
    def _replace(queue: asyncio.Queue, item: str | None) -> None:
        if queue.full():
            queue.get_nowait()  # the reader has not taken the previous one: it gets the newest instead
        queue.put_nowait(item)


def _watch(request: Request) -> KVWatch:
    state = request.app.state.kvserve
    engine = state.ready_engine()
    _check_in_process(engine)
    watch = getattr(request.app.state, "kv_watch", None)
    if watch is None or watch.engine is not engine:
        watch = request.app.state.kv_watch = KVWatch(engine, lambda: state.shutting_down)
    return watch


async def _events(watch: KVWatch) -> AsyncIterator[str]:
    queue = watch.subscribe()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + KV_STREAM_MAX_S
    try:
        while (left := deadline - loop.time()) > 0:
            try:
                data = await asyncio.wait_for(queue.get(), min(KEEP_ALIVE_S, left))
            except asyncio.TimeoutError:  # the builtin TimeoutError on 3.11+, not on 3.10
                yield ": keep-alive\n\n"
                continue
            if data is None:
                return
            yield f"data: {data}\n\n"
    finally:  # also when the client leaves: the response cancels this generator
        watch.unsubscribe(queue)


@router.get("/kv", response_model=KVSnapshot)
async def kv(request: Request) -> KVSnapshot:
    """The block pool now: counts, each block's holders and hits, the cached blocks in eviction order."""
    return await take_snapshot(request.app.state.kvserve.ready_engine())


@router.get(
    "/kv/stream",
    response_class=EventStreamResponse,
    responses={200: {"content": {EVENT_STREAM: {"schema": json_events(KVSnapshot)}}}},
)
async def kv_stream(request: Request) -> StreamingResponse:
    """Snapshots as Server-Sent Events: the current one at once, then each change, at most one per
    KV_STREAM_PERIOD; the stream ends after KV_STREAM_MAX_S or when the server shuts down."""
    return StreamingResponse(_events(_watch(request)), media_type="text/event-stream", headers=SSE_HEADERS)
