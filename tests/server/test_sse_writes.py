"""A stream's events that reach the server together leave in one body chunk (server/api/sse.py `guarded`):
the client reads the same SSE events, in fewer writes."""
import asyncio

import httpx

from server.api.app import create_app
from server.api.sse import guarded
from server.engine import EngineArgs, EngineConfig, Engine
from tests.server.conftest import TEST_DEVICE, LiveServer, sse_events

LONG_MS = 600_000.0  # no request outlasts it: a request's tokens after its first wait for its last
TOKENS = 12


class BodyWrites:
    """The app, recording the body chunks of its streamed responses as the server is handed them."""

    def __init__(self, app) -> None:
        self.app, self.writes = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/generate_stream":
            return await self.app(scope, receive, send)

        async def recording(message):
            if message["type"] == "http.response.body" and message.get("body"):
                self.writes.append(message["body"])
            await send(message)
        await self.app(scope, receive, recording)


def stream_writes(checkpoint, interval_ms: float) -> tuple[list[dict | str], int]:
    args = EngineArgs(checkpoint=checkpoint, device=TEST_DEVICE,
                      config=EngineConfig(threads=1, stream_interval_ms=interval_ms))
    app = BodyWrites(create_app(lambda: Engine.from_args(args), model_name="tiny"))
    server = LiveServer(app).start()
    try:
        body = {"inputs": "To be, or not", "parameters": {"max_new_tokens": TOKENS, "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
            with client.stream("POST", "/generate_stream", json=body) as r:
                assert r.status_code == 200
                events = sse_events(r.iter_lines())
        return events, len(app.writes)
    finally:
        server.stop()


def test_tokens_that_arrive_together_leave_in_one_write_and_read_the_same(tiny_checkpoint):
    every_step, _ = stream_writes(tiny_checkpoint, 0.0)
    held, writes = stream_writes(tiny_checkpoint, LONG_MS)
    assert [e["token"]["id"] for e in held] == [e["token"]["id"] for e in every_step]
    assert len(held) == TOKENS and held[-1]["details"]["generated_tokens"] == TOKENS
    assert writes <= 3  # the first token, maybe the second, then the rest with the last


def test_without_more_ready_each_event_is_its_own_write_and_a_failure_goes_with_what_was_joined():
    async def events():
        yield "data: 1\n\n"
        yield "data: 2\n\n"
        yield "data: 3\n\n"
        raise RuntimeError("broken")

    async def chunks(ready):
        return [c async for c in guarded(events(), ready=ready)]

    alone = asyncio.run(chunks(None))
    assert alone[:3] == ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"] and "broken" in alone[3] and len(alone) == 4
    joined = asyncio.run(chunks(lambda: True))  # everything had arrived: one write, the error event last
    assert len(joined) == 1 and joined[0] == "".join(alone)
