"""Server-Sent Events: one event's text, a streamed response, and a failure as the stream's last event."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from server.api.errors import APIError, error_body
from server.engine import TokenOutput

log = logging.getLogger("kvserve.serving")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"  # an OpenAI stream's last event, after its last chunk or its error
NOTHING_YET = ""  # what a stream's generator yields for an event it took but holds (text held back): see `guarded`


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data, ensure_ascii=False)
    return f"data: {data}\n\n"


def error_event(out: TokenOutput, openai: bool = False) -> str:
    """A failed request's last event, in TGI's error shape or (`openai`) OpenAI's."""
    error = APIError.of_failed_generation(out.error_type, out.error)
    return "data: " + error.response(openai).body.decode() + "\n\n"


def sse_response(
    events: AsyncIterator[str],
    on_close: Callable[[], None],
    openai: bool = False,
    more_ready: Callable[[], bool] | None = None,
) -> StreamingResponse:
    """A stream whose failure ends it with an error event in the route's shape (`openai`: OpenAI's).
    `more_ready` (the Generation's `has_ready`) says that more of the engine's events have already arrived:
    the events made of them go out with this one, in one write (see `guarded`).
    `on_close` (the Generation's cancel) runs once the response is over, also when the client left
    before its first event (then `events` never started, so its own cleanup never runs). It runs on the
    event loop: Starlette hands a plain function to a worker thread, a thread hop per response, and the
    cluster's engine client cancels asyncio tasks, which only the loop's thread may do."""

    async def close() -> None:
        on_close()

    return StreamingResponse(
        guarded(events, openai, more_ready),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
        background=BackgroundTask(close),
    )


async def guarded(
    events: AsyncIterator[str], openai: bool = False, more_ready: Callable[[], bool] | None = None
) -> AsyncIterator[str]:
    """A failure inside a stream becomes its last event instead of a torn connection.

    With `more_ready`, events are joined while it says that more have arrived: tokens that reach the
    server together (a step's copies, or the steps an engine's --stream-interval-ms held back) leave in
    one body chunk, one socket write, where each would be a write of its own. The client reads the same
    bytes, one SSE event a token. `events` yields for every engine event it takes, `NOTHING_YET` for one
    whose text it holds back, so that what was joined goes out before it waits for the next: nothing that
    has arrived waits for an event that has not."""
    joined: list[str] = []
    try:
        async for event in events:
            if event:
                joined.append(event)
            if joined and not (more_ready is not None and more_ready()):
                yield "".join(joined)
                joined.clear()
    except Exception as e:  # noqa: BLE001 - anything here must reach the client as an error event
        log.exception("stream failed")
        joined.append(sse(error_body(500, f"{type(e).__name__}: {e}", "generation", openai)))
        if openai:  # as after an engine's error: OpenAI's clients read to [DONE]
            joined.append(DONE)
    if joined:
        yield "".join(joined)
