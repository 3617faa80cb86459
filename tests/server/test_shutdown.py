"""Graceful shutdown: new requests are refused, those in flight finish within the grace period or end with
a final 'shutdown' event, and a SIGTERM'd server process exits with status 0."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.server.conftest import ServerProcess, blocks_free, serve, sse_events, wait_for

LONG = {"inputs": "To be", "parameters": {"max_new_tokens": 100, "ignore_eos": True}}


def stream_in_thread(
    url: str, body: dict, results: list, first_token: threading.Event | None = None
) -> threading.Thread:
    """Streams `body` from /generate_stream in a thread; appends ("events", [...]), ("status", code)
    or ("torn", error) to `results`; sets `first_token` at the first event."""

    def run():
        events = []
        try:
            with (
                httpx.Client(timeout=120, trust_env=False) as c,
                c.stream("POST", url + "/generate_stream", json=body) as r,
            ):
                if r.status_code != 200:
                    results.append(("status", r.status_code))
                    return
                for line in r.iter_lines():
                    events += sse_events([line])
                    if first_token is not None and events:
                        first_token.set()
        except httpx.TransportError as e:
            results.append(("torn", repr(e)))
            return
        results.append(("events", events))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def draining(tiny_checkpoint, request):
    server = serve(tiny_checkpoint, app_kw={"shutdown_grace": request.param}, max_num_seqs=1, max_waiting=4)
    yield server
    server.stop()


@pytest.mark.parametrize("draining", [60.0], indirect=True)
def test_after_shutdown_begins_new_requests_get_503_and_those_in_flight_finish(draining):
    engine, state = draining.engine, draining.app.state.kvserve
    results: list = []
    with engine.paused():
        thread = stream_in_thread(draining.url, LONG, results)
        wait_for(lambda: engine.num_waiting == 1, "the request to queue")
        state.begin_shutdown()
        r = httpx.post(draining.url + "/generate", json=LONG, timeout=30)
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
        assert draining.metric("kvserve:request_rejected_total", reason="shutting_down") == 1
        assert httpx.get(draining.url + "/health").status_code == 503
    thread.join(60)
    kind, events = results[0]
    assert kind == "events" and events[-1]["details"]["finish_reason"] == "length", events[-1]
    assert events[-1]["details"]["generated_tokens"] == 100


@pytest.mark.parametrize("draining", [0.0], indirect=True)
def test_requests_still_running_after_the_grace_end_with_a_shutdown_event(draining):
    engine, state = draining.engine, draining.app.state.kvserve
    results: list = []
    with engine.paused():
        threads = [stream_in_thread(draining.url, LONG, results) for _ in range(2)]
        wait_for(lambda: engine.num_waiting == 2, "two requests to queue")
        engine.step()  # one takes the slot and streams its first token; the other waits
        state.begin_shutdown()
    for t in threads:
        t.join(60)
    assert sorted(kind for kind, _ in results) == ["events", "events"], results
    for _, events in results:
        assert events[-1] == {"error": "the server shut down before this request finished", "error_type": "shutdown"}
    assert engine.num_running == engine.num_waiting == 0 and blocks_free(engine)


def run_until_sigterm(checkpoint, grace: str, bodies: list[dict]) -> tuple[list, ServerProcess]:
    server = ServerProcess(checkpoint, "--max-num-seqs", "1", "--max-waiting", "64", "--shutdown-grace", grace)
    try:
        server.wait_healthy()
        results: list = []
        first_token = threading.Event()
        threads = [stream_in_thread(server.url, body, results, first_token) for body in bodies]
        assert first_token.wait(60), "no token streamed"
        wait_for(
            lambda: (
                server.metric("kvserve:num_requests_running")
                + server.metric("kvserve:num_requests_waiting")
                + len(results)
                >= len(bodies)
            ),
            "every request to be in",
        )
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.output()
        for t in threads:
            t.join(60)
        return results, server
    finally:
        server.stop()


def test_sigterm_lets_streams_finish_and_the_process_exits_0(tiny_checkpoint):
    results, server = run_until_sigterm(tiny_checkpoint, "60", [LONG] * 3)
    assert [kind for kind, _ in results] == ["events"] * 3, results
    assert all(events[-1]["details"]["generated_tokens"] == 100 for _, events in results)
    with pytest.raises(httpx.ConnectError):  # the port is closed
        httpx.get(server.url + "/health")


def test_sigterm_past_the_grace_ends_streams_with_a_shutdown_event_and_exits_0(tiny_checkpoint):
    body = {"inputs": "To be", "parameters": {"max_new_tokens": 120, "ignore_eos": True, "use_cache": False}}
    results, _ = run_until_sigterm(tiny_checkpoint, "0", [body] * 8)
    assert [kind for kind, _ in results] == ["events"] * 8, results  # none refused, no connection torn
    endings = [events[-1] for _, events in results]
    shut = [e for e in endings if e.get("error_type") == "shutdown"]
    finished = [e for e in endings if e.get("details", {}).get("generated_tokens") == 120]
    assert shut and len(shut) + len(finished) == 8, endings
