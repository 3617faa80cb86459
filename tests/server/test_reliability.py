"""Faults, deadlines and load: a broken request fails alone, a deadline ends a request and frees its slot,
stop strings never leak over HTTP, and a soak of mixed, partly abandoned requests leaves nothing behind."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import threading

import httpx
import pytest
import torch

from server.api.limits import Limits
from server.engine.model_runner import ModelRunner
from tests.server.conftest import ServerProcess, blocks_free, hook_sampling, serve, sse_events, wait_for

GREEDY = {"max_new_tokens": 12, "ignore_eos": True}


def generate(live, inputs: str, **parameters) -> httpx.Response:
    return httpx.post(live.url + "/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60)


def run_together(live, bodies: list[dict]) -> list[httpx.Response]:
    """Posts every body while the engine is paused, so all of them share the same batches."""
    results: list = [None] * len(bodies)

    def post(i: int) -> None:
        results[i] = httpx.post(live.url + "/generate", json=bodies[i], timeout=60)

    with live.engine.paused():
        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        wait_for(lambda: live.engine.num_waiting == len(bodies), "every request to queue")
    for t in threads:
        t.join(60)
    return results


# ---- engine faults ---------------------------------------------------------------------------------


@pytest.fixture
def nan_logits_for_seed_17(monkeypatch):
    """Decode steps give NaN logits in the rows of requests with seed 17, as a broken kernel would."""

    def before(reqs, logits):
        for i, r in enumerate(reqs):
            if r.params.seed == 17 and r.num_output_tokens > 0:
                logits[i] = float("nan")

    hook_sampling(monkeypatch, before=before)


def test_nan_logits_in_one_row_fail_that_request_only(live, nan_logits_for_seed_17):
    prompts = ["To be", "Whether 'tis", "the slings", "Emoji"]
    solo = [generate(live, p, **GREEDY).json()["generated_text"] for p in prompts]
    bodies = [{"inputs": p, "parameters": GREEDY} for p in prompts]
    bodies.insert(2, {"inputs": "To be", "parameters": {**GREEDY, "seed": 17}})  # greedy, marked by its seed
    results = run_together(live, bodies)
    broken = results.pop(2)
    assert broken.status_code == 424 and broken.json()["error_type"] == "generation"  # TGI's GenerationError
    assert "non-finite logits" in broken.json()["error"]
    openai = httpx.post(
        live.url + "/v1/completions",
        timeout=60,  # OpenAI's routes answer it as vLLM does: 500
        json={"prompt": "To be", "max_tokens": 4, "temperature": 0, "seed": 17},
    )
    assert openai.status_code == 500 and openai.json()["error"]["type"] == "server_error"
    assert [r.json()["generated_text"] for r in results] == solo
    with live.client() as c:  # streamed: the first token (from prefill) arrives, then the error event
        events = sse_events(c.post("/generate_stream", json=bodies[2]).iter_lines())
    assert [e.get("index") for e in events[:-1]] == [1]
    assert events[-1]["error_type"] == "generation" and "non-finite" in events[-1]["error"]
    wait_for(lambda: blocks_free(live.engine) and live.engine.num_running == 0, "the slots to be freed")


def test_a_stream_that_breaks_ends_with_an_error_event_in_its_routes_shape(live, monkeypatch):
    """An exception while a stream is written (here, encoding an OpenAI chunk) ends it with an event in
    OpenAI's error shape on /v1/, then [DONE], as an engine's error does; the request's blocks come back."""
    from server.api.serving_completions import ChunkEncoder

    def broken(self, choice, usage=None):
        raise RuntimeError("chunk encoder broke (injected)")

    monkeypatch.setattr(ChunkEncoder, "__call__", broken)
    body = {"prompt": "To be", "max_tokens": 4, "stream": True}
    with live.client() as c:
        events = [
            line[5:].strip() for line in c.post("/v1/completions", json=body).iter_lines() if line.startswith("data:")
        ]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "generation") and "injected" in error["message"]
    wait_for(lambda: blocks_free(live.engine) and live.engine.num_running == 0, "the slots to be freed")


def test_a_broken_stream_on_tgis_routes_ends_in_tgis_shape():
    from server.api.sse import guarded

    async def events():
        yield "data: {}\n\n"
        raise RuntimeError("broke")

    async def collect():
        return [e async for e in guarded(events())]

    last = asyncio.run(collect())[-1]
    assert json.loads(last.removeprefix("data: ")) == {"error": "RuntimeError: broke", "error_type": "generation"}


@pytest.fixture
def out_of_memory_for_seed_19(monkeypatch):
    """Any forward holding a seed-19 request raises out-of-memory, as a GPU that ran out would."""
    real = ModelRunner.run

    def run(self, batch):
        if any(r.params.seed == 19 for r in batch.num_tokens):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "run", run)


def test_out_of_memory_in_one_request_fails_it_alone_and_the_others_match_their_solo_results(
    live, out_of_memory_for_seed_19
):
    prompts = ["To be", "the slings", "Emoji"]
    solo = [generate(live, p, **GREEDY).json()["generated_text"] for p in prompts]
    bodies = [{"inputs": p, "parameters": GREEDY} for p in prompts] + [
        {"inputs": "x", "parameters": {**GREEDY, "seed": 19, "use_cache": False}}
    ]
    results = run_together(live, bodies)
    assert results[-1].status_code == 424 and "OutOfMemoryError" in results[-1].json()["error"]
    assert [r.json()["generated_text"] for r in results[:-1]] == solo
    wait_for(lambda: blocks_free(live.engine) and live.engine.num_running == 0, "the slots to be freed")


# ---- deadlines -------------------------------------------------------------------------------------


def test_limits_deadline_is_what_the_request_asks_capped_by_the_server():
    assert Limits().deadline(None) is None
    assert Limits().deadline(5.0) == 5.0
    assert Limits(request_timeout=2.0).deadline(None) == 2.0
    assert Limits(request_timeout=2.0).deadline(5.0) == 2.0
    assert Limits(request_timeout=2.0).deadline(0.5) == 0.5


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_ends_with_a_timeout_error_and_frees_its_slot(small_live, stream):
    engine = small_live.engine
    timeouts = small_live.metric("kvserve:request_rejected_total", reason="timeout")
    body = {"inputs": "To be", "parameters": {"max_new_tokens": 50, "ignore_eos": True, "timeout": 1.0}}
    result: list = []

    def call():
        with small_live.client() as c:
            r = c.post("/generate_stream" if stream else "/generate", json=body)
            result.append((r.status_code, sse_events(r.iter_lines()) if stream else r.json()))

    with engine.paused():  # no step runs: the request cannot finish before its deadline
        thread = threading.Thread(target=call)
        thread.start()
        wait_for(
            lambda: small_live.metric("kvserve:request_rejected_total", reason="timeout") == timeouts + 1,
            "the deadline to pass",
        )
    thread.join(60)
    status, answer = result[0]
    final = answer[-1] if stream else answer
    assert status == (200 if stream else 504), answer
    assert final["error_type"] == "timeout" and "deadline of 1 s" in final["error"], final
    wait_for(lambda: engine.num_running == engine.num_waiting == 0 and blocks_free(engine), "a free slot")
    assert generate(small_live, "To be", max_new_tokens=2).status_code == 200


# ---- streaming text integrity ----------------------------------------------------------------------


def test_a_stop_string_spanning_tokens_is_honoured_and_never_streamed(live):
    full = generate(live, "To be", max_new_tokens=40, ignore_eos=True, details=True).json()
    texts = [t["text"] for t in full["details"]["tokens"]]
    text = "".join(texts)
    # a stop made of the end of one token and the start of the next, first found where they meet
    starts = [sum(map(len, texts[:i])) for i in range(len(texts))]
    stop = next(
        s
        for i, s in ((i, texts[i - 1][-2:] + texts[i][:1]) for i in range(1, len(texts)))
        if len(s) == 3 and text.index(s) == starts[i] - 2 > 0
    )
    expected = text[: text.index(stop)]
    assert expected, stop
    r = generate(live, "To be", max_new_tokens=40, ignore_eos=True, stop=[stop], details=True).json()
    assert r["generated_text"] == expected and r["details"]["finish_reason"] == "stop_sequence", (stop, r)
    with live.client() as c:
        events = sse_events(
            c.post(
                "/generate_stream",
                json={"inputs": "To be", "parameters": {"max_new_tokens": 40, "ignore_eos": True, "stop": [stop]}},
            ).iter_lines()
        )
    streamed = "".join(e["token"]["text"] for e in events)
    assert streamed == expected and stop not in streamed and events[-1]["generated_text"] == expected


def test_multibyte_characters_and_a_multibyte_stop_stream_whole(live):
    prompt = "世界你好，莎士比亚。 Emoji 🤖🎭"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 30, "do_sample": True, "seed": 3, "details": True}}
    whole = httpx.post(live.url + "/generate", json=body, timeout=60).json()["generated_text"]
    with live.client() as c:
        events = sse_events(c.post("/generate_stream", json=body).iter_lines())
    assert "".join(e["token"]["text"] for e in events) == whole
    for e in events:
        e["token"]["text"].encode("utf-8")  # a lone surrogate (a torn character) would raise here
    stop = "\ufffd"  # the tiny model often emits bytes that are no character: they decode to U+FFFD
    assert stop in whole, whole
    stopped = httpx.post(
        live.url + "/generate", json={**body, "parameters": {**body["parameters"], "stop": [stop]}}, timeout=60
    ).json()["generated_text"]
    assert stopped == whole[: whole.index(stop)]


# ---- a soak of mixed requests against the real process ---------------------------------------------

PROMPTS = [
    "To be",
    "Whether 'tis nobler",
    "the slings and arrows",
    "世界你好",
    "Emoji 🤖",
    "naïve café",
    "question:",
    "outrageous fortune.",
]
SOAK_REQUESTS, WARMUP_REQUESTS, CANCEL_SHARE = 300, 60, 0.15


def soak_request(rng: random.Random, model: str) -> dict:
    """One request of the mix: TGI or OpenAI, streamed or not, cached or not, greedy or sampled."""
    greedy = rng.random() < 0.5
    req = {
        "model": model,
        "prompt": rng.choice(PROMPTS),
        "stream": rng.random() < 0.5,
        "openai": rng.random() < 0.25,
        "use_cache": rng.random() < 0.75,
        "greedy": greedy,
        "cancel": rng.random() < CANCEL_SHARE,
        "cancel_after": rng.choice([0, 1, 3]),
        "cancel_delay": rng.uniform(0.0, 0.05),
    }
    if greedy:
        req["params"] = {"max_new_tokens": rng.choice([8, 16]), "ignore_eos": True}
    else:
        req["params"] = {
            "max_new_tokens": rng.randint(1, 24),
            "temperature": rng.uniform(0.3, 1.5),
            "top_k": rng.choice([None, 5, 50]),
            "top_p": rng.choice([None, 0.9]),
            "seed": rng.randrange(2**31),
            "ignore_eos": rng.random() < 0.5,
            "stop": rng.choice([[], ["e"], ["the", "\n"]]),
        }
    return req


def http_body(req: dict) -> tuple[str, dict]:
    p = req["params"]
    if req["openai"]:
        body = {
            "model": req["model"],
            "prompt": req["prompt"],
            "max_tokens": p["max_new_tokens"],
            "stream": req["stream"],
            "use_cache": req["use_cache"],
            "ignore_eos": p["ignore_eos"],
        }
        if req["greedy"]:
            body["temperature"] = 0
        else:
            body.update(
                temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"], seed=p["seed"], stop=p["stop"] or None
            )
        return "/v1/completions", body
    params = {k: v for k, v in p.items() if v is not None and v != []}
    params["use_cache"] = req["use_cache"]
    if not req["greedy"]:
        params["do_sample"] = True
    return ("/generate_stream" if req["stream"] else "/generate"), {"inputs": req["prompt"], "parameters": params}


async def send(client: httpx.AsyncClient, req: dict) -> tuple[str, str | None]:
    """-> (outcome, generated text): outcome is ok, cancelled, or a description of the failure."""
    path, body = http_body(req)
    if not req["stream"]:
        try:  # a cancelling client gives up after a moment: its connection closes
            r = await asyncio.wait_for(client.post(path, json=body), req["cancel_delay"] if req["cancel"] else None)
        except asyncio.TimeoutError:
            return "cancelled", None
        if r.status_code != 200:
            return f"status {r.status_code}: {r.text[:200]}", None
        data = r.json()
        return "ok", data["choices"][0]["text"] if req["openai"] else data["generated_text"]
    events = []
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}", None
        async for line in r.aiter_lines():
            events += sse_events([line])
            if req["cancel"] and len(events) > req["cancel_after"]:
                return "cancelled", None  # leaving the block closes the connection mid-stream
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return f"error event {errors}", None
    if req["openai"]:
        if events[-1] != "[DONE]":
            return "no [DONE]", None
        return "ok", "".join(e["choices"][0]["text"] for e in events[:-1])
    if events[-1].get("generated_text") is None:
        return "no final event", None
    return "ok", events[-1]["generated_text"]


async def soak(url: str, reqs: list[dict], concurrency: int = 48) -> list[tuple[str, str | None]]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as client:

        async def one(req):
            async with gate:
                return await send(client, req)

        return await asyncio.gather(*(one(r) for r in reqs))


def greedy_key(req: dict) -> tuple:
    return req["prompt"], req["params"]["max_new_tokens"]


def test_soak_mixed_requests_with_disconnects_leave_nothing_behind(tiny_checkpoint, record_property):
    rng, model = random.Random(1234), tiny_checkpoint.name  # the process serves the model by its folder's name
    server = ServerProcess(tiny_checkpoint, "--max-num-seqs", "8", "--max-waiting", "512")
    try:
        server.wait_healthy()
        solo_reqs = [
            {
                "prompt": p,
                "params": {"max_new_tokens": n, "ignore_eos": True},
                "stream": False,
                "openai": False,
                "use_cache": True,
                "greedy": True,
                "cancel": False,
            }
            for p in PROMPTS
            for n in (8, 16)
        ]
        solo_out = asyncio.run(soak(server.url, solo_reqs, concurrency=1))
        solo = {greedy_key(r): text for r, (_, text) in zip(solo_reqs, solo_out)}
        asyncio.run(soak(server.url, [soak_request(rng, model) for _ in range(WARMUP_REQUESTS)]))
        wait_for(lambda: server.metric("kvserve:num_requests_running") == 0, "the warm-up to drain")
        rss_before = server.rss_bytes()

        reqs = [soak_request(rng, model) for _ in range(SOAK_REQUESTS)]
        results = asyncio.run(soak(server.url, reqs))

        failures = [(r, out) for r, (out, _) in zip(reqs, results) if out not in ("ok", "cancelled")]
        cancelled = sum(out == "cancelled" for out, _ in results)
        mismatched = [
            (greedy_key(r), text, solo[greedy_key(r)])
            for r, (out, text) in zip(reqs, results)
            if out == "ok" and r["greedy"] and text != solo[greedy_key(r)]
        ]
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            wait_for(lambda gauge=gauge: server.metric("kvserve:" + gauge) == 0, f"{gauge} back to 0", timeout=30)
        rss_after = server.rss_bytes()
        errors = server.metric("kvserve:request_success_total", finished_reason="error")
        aborted = server.metric("kvserve:request_success_total", finished_reason="abort")
        greedy_checked = sum(out == "ok" and r["greedy"] for r, (out, _) in zip(reqs, results))
        figures = {
            "requests": SOAK_REQUESTS,
            "failures": len(failures),
            "cancelled": cancelled,
            "aborted_server_side": int(aborted),
            "greedy_checked": greedy_checked,
            "greedy_mismatches": len(mismatched),
            "rss_before_mib": round(rss_before / 2**20, 1),
            "rss_after_mib": round(rss_after / 2**20, 1),
        }
        print(f"\nsoak: {figures}")
        record_property("soak", figures)
        assert not failures, failures[:5]
        assert not mismatched, mismatched[:5]
        assert errors == 0
        assert cancelled > 0 and cancelled < SOAK_REQUESTS  # the mix did abandon some, and served the rest
        assert rss_after < rss_before * 1.2 + 32 * 2**20, figures  # no growth with the number of requests
        assert httpx.post(server.url + "/generate", json={"inputs": "To be"}, timeout=60).status_code == 200
    finally:
        server.stop()


def test_a_ready_server_has_frozen_what_loading_left_out_of_the_collectors_way(tiny_checkpoint):
    """A full garbage collection holds every thread, the engine's too; over a loaded server's heap it is a
    stall of every stream (BENCHMARKS.md). Once ready, the server has frozen that heap."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    server = serve(tiny_checkpoint)
    try:
        assert gc.get_freeze_count() > 0
    finally:
        server.stop()
