"""A stream's events that reach the server together leave in one body chunk (server/api/sse.py `guarded`):
the client reads the same SSE events, in fewer writes."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from server.api.app import create_app
from server.api.protocol_openai import ChatCompletionRequest, CompletionRequest, CompletionResponse
from server.api.serving_chat import _chat_events
from server.api.serving_completions import LogprobsBuilder, _completion_events
from server.api.sse import guarded
from server.engine import Engine, EngineArgs, EngineConfig, TokenOutput
from tests.server.conftest import TEST_DEVICE, LiveServer, sse_events

LONG_MS = 600_000.0  # no request outlasts it: a request's tokens after its first wait for its last
TOKENS = 12
STREAMS = {  # route -> a streamed request of TOKENS tokens
    "/generate_stream": {"inputs": "To be, or not", "parameters": {"max_new_tokens": TOKENS, "ignore_eos": True}},
    "/v1/completions": {
        "prompt": "To be, or not",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
        "logprobs": 0,
    },
}


class BodyWrites:
    """The app, recording the body chunks of its streamed responses as the server is handed them."""

    def __init__(self, app) -> None:
        self.app, self.writes = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in STREAMS:
            return await self.app(scope, receive, send)

        async def recording(message):
            if message["type"] == "http.response.body" and message.get("body"):
                self.writes.append(message["body"])
            await send(message)

        await self.app(scope, receive, recording)


def stream_writes(checkpoint, interval_ms: float, route: str) -> tuple[list[dict | str], int]:
    args = EngineArgs(
        checkpoint=checkpoint, device=TEST_DEVICE, config=EngineConfig(threads=1, stream_interval_ms=interval_ms)
    )
    app = BodyWrites(create_app(lambda: Engine.from_args(args), model_name="tiny"))
    server = LiveServer(app).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
            with client.stream("POST", route, json=STREAMS[route]) as r:
                assert r.status_code == 200
                events = sse_events(r.iter_lines())
        return events, len(app.writes)
    finally:
        server.stop()


def tokens_of(events: list[dict | str]) -> list[int | str]:
    """TGI's token ids, or OpenAI's token texts (a chunk's logprobs list every token since the last chunk)."""
    tokens = []
    for e in events:
        if isinstance(e, dict) and "token" in e:
            tokens.append(e["token"]["id"])
        elif isinstance(e, dict) and e.get("choices"):
            tokens += e["choices"][0]["logprobs"]["tokens"]
    return tokens


@pytest.mark.parametrize("route", STREAMS)
def test_tokens_that_arrive_together_leave_in_one_write_and_read_the_same(tiny_checkpoint, route):
    every_step, _ = stream_writes(tiny_checkpoint, 0.0, route)
    held, writes = stream_writes(tiny_checkpoint, LONG_MS, route)
    assert tokens_of(held) == tokens_of(every_step) and len(tokens_of(held)) == TOKENS
    assert writes <= 3  # the first token, maybe the second, then the rest with the last (and [DONE])


def _completions(tokenizer, events):
    body = CompletionRequest(prompt="x", stream=True)
    head = CompletionResponse(id="cmpl-test", created=0, model="tiny", choices=[])
    return _completion_events(
        events, head, body, [[1]], ["x"], LogprobsBuilder(SimpleNamespace(tokenizer=tokenizer), None), None
    )


def _chat(tokenizer, events):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    return _chat_events(
        SimpleNamespace(tokenizer=tokenizer), events, dict(id="chatcmpl-test", created=0, model="tiny"), body, [1]
    )


@pytest.mark.parametrize("route", [_completions, _chat])
def test_what_was_joined_goes_out_before_the_stream_waits_for_an_event_that_has_not_arrived(tiny_tokenizer, route):
    """Two tokens arrive together, the second with its text held back (''), then nothing more for now: the
    first, joined because the second had arrived, goes out before the route waits for a third."""
    taken = [0]  # events the route has taken; the first two arrived together

    async def events():
        for token in (TokenOutput("r", 1, 7, "a", -0.1, False, None), TokenOutput("r", 2, 8, "", -0.1, False, None)):
            taken[0] += 1
            yield 0, token
        await asyncio.Event().wait()  # the third never comes
        yield 0, TokenOutput("r", 3, 9, "b", -0.1, True, "length")

    async def first_write():
        stream = guarded(route(tiny_tokenizer, events()), more_ready=lambda: taken[0] < 2)
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout=10)
        finally:
            await stream.aclose()

    first = asyncio.run(first_write())
    assert '"a"' in first and "never" not in first


def test_without_more_ready_each_event_is_its_own_write_and_a_failure_goes_with_what_was_joined():
    async def events():
        yield "data: 1\n\n"
        yield "data: 2\n\n"
        yield "data: 3\n\n"
        raise RuntimeError("broken")

    async def chunks(ready):
        return [c async for c in guarded(events(), more_ready=ready)]

    alone = asyncio.run(chunks(None))
    assert alone[:3] == ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"] and "broken" in alone[3] and len(alone) == 4
    joined = asyncio.run(chunks(lambda: True))  # everything had arrived: one write, the error event last
    assert len(joined) == 1 and joined[0] == "".join(alone)
