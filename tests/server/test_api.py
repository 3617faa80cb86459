"""The HTTP API against a live server: TGI JSON and SSE, OpenAI completions, concurrency, metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from model import kernels
from tests.conftest import EXACT
from tests.server.conftest import hook_sampling, sse_events, wait_for


def generate(live, inputs, **parameters):
    r = httpx.post(live.url + "/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(live, inputs, path="/generate_stream", headers=None, **parameters):
    with (
        live.client() as c,
        c.stream("POST", path, json={"inputs": inputs, "parameters": parameters}, headers=headers) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def test_generate_returns_text_and_tgi_details(live):
    out = generate(live, "To be, or not", max_new_tokens=8, details=True, seed=3, do_sample=True)
    d = out["details"]
    assert isinstance(out["generated_text"], str)
    assert d["generated_tokens"] == len(d["tokens"]) <= 8 and d["seed"] == 3 and d["prefill"] == []
    assert d["finish_reason"] in ("length", "eos_token")
    assert set(d["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert "".join(t["text"] for t in d["tokens"]) == out["generated_text"]
    assert d["use_cache"] is True and d["time_to_first_token_s"] >= 0 and d["queue_time_s"] >= 0
    assert "details" not in generate(live, "To be", max_new_tokens=2)


def test_stream_tokens_concatenate_to_the_non_streamed_text_for_the_same_seed(live):
    params = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=40, seed=7, details=True)
    whole = generate(live, "Whether 'tis nobler", **params)
    events = stream(live, "Whether 'tis nobler", **params)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"] == events[-1]["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert events[-1]["details"]["generated_tokens"] == len(events)


def test_generate_streams_when_asked_by_body_or_accept_header(live):
    plain = generate(live, "To be", max_new_tokens=5)["generated_text"]
    with live.client() as c:
        by_body = sse_events(
            c.post(
                "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 5}, "stream": True}
            ).iter_lines()
        )
    by_header = stream(live, "To be", path="/generate", headers={"Accept": "text/event-stream"}, max_new_tokens=5)
    assert by_body[-1]["generated_text"] == by_header[-1]["generated_text"] == plain


def test_compat_route_answers_a_list_or_a_stream(live):
    body = {"inputs": "To be", "parameters": {"max_new_tokens": 4}}
    listed = httpx.post(live.url + "/", json=body, timeout=60).json()
    assert (
        isinstance(listed, list)
        and listed[0]["generated_text"] == generate(live, "To be", max_new_tokens=4)["generated_text"]
    )
    with live.client() as c:
        events = sse_events(c.post("/", json={**body, "stream": True}).iter_lines())
    assert events[-1]["generated_text"] == listed[0]["generated_text"]


def test_return_full_text_prepends_the_prompt(live):
    out = generate(live, "To be", max_new_tokens=4, return_full_text=True)["generated_text"]
    assert out == "To be" + generate(live, "To be", max_new_tokens=4)["generated_text"]


def test_sixteen_concurrent_greedy_requests_match_their_solo_results(live):
    prompts = [f"{w} {i}" for i, w in enumerate(["To be", "or not", "the question", "世界", "🤖 and", "café"] * 3)]
    alone = [generate(live, p, max_new_tokens=12, details=True) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        with live.engine.paused():  # let all 18 queue up, so they are admitted and decoded as one batch
            futures = [pool.submit(generate, live, p, max_new_tokens=12, details=True) for p in prompts]
            wait_for(lambda: live.engine.num_waiting == len(prompts), "every request to queue")
            assert httpx.get(live.url + "/health").status_code == 200, "the event loop must not wait on the engine"
        together = [f.result() for f in futures]
    for p, a, t in zip(prompts, alone, together):
        assert [x["id"] for x in t["details"]["tokens"]] == [x["id"] for x in a["details"]["tokens"]], p
        if EXACT:  # identical means identical: the same logprobs, to the last bit, alone and among 17 others
            assert [x["logprob"] for x in t["details"]["tokens"]] == [x["logprob"] for x in a["details"]["tokens"]], p
    assert live.metric("kvserve:num_requests_running") == 0


def test_use_cache_false_gives_the_same_greedy_text(live):
    for prompt in ("To be, or not to be", "世界你好"):
        cached = generate(live, prompt, max_new_tokens=15, details=True)
        uncached = generate(live, prompt, max_new_tokens=15, details=True, use_cache=False)
        assert uncached["generated_text"] == cached["generated_text"]
        assert uncached["details"]["use_cache"] is False
        if EXACT:
            assert [t["logprob"] for t in uncached["details"]["tokens"]] == [
                t["logprob"] for t in cached["details"]["tokens"]
            ]


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache_with_the_same_logprobs(live):
    prompt = "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune " * 2
    first = generate(live, prompt, max_new_tokens=10, details=True, cache_salt="prefix-test")
    again = generate(live, prompt, max_new_tokens=10, details=True, cache_salt="prefix-test")
    assert first["details"]["cached_tokens"] == 0 and again["details"]["cached_tokens"] >= 16
    assert again["generated_text"] == first["generated_text"]
    if EXACT:
        assert [t["logprob"] for t in again["details"]["tokens"]] == [t["logprob"] for t in first["details"]["tokens"]]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "cache_salt": "prefix-test"}
    usage = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == again["details"]["cached_tokens"]
    assert live.metric("kvserve:prefix_cache_hits_total") >= 2 * again["details"]["cached_tokens"]
    assert live.metric("kvserve:prefix_cache_queries_total") > live.metric("kvserve:prefix_cache_hits_total")


def test_chinese_and_emoji_stream_without_broken_characters(live):
    for prompt in ("世界你好，莎士比亚。", "Emoji 🤖🎭 and"):
        events = stream(live, prompt, max_new_tokens=40)
        texts = [e["token"]["text"] for e in events]
        assert all("\ufffd" not in t for t in texts), texts
        assert "".join(texts) == events[-1]["generated_text"]


def test_openai_completion_non_streaming(live):
    r = httpx.post(
        live.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "To be", "max_tokens": 6, "temperature": 0, "logprobs": 0},
    )
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == generate(live, "To be", max_new_tokens=6)["generated_text"]
    assert choice["finish_reason"] in ("length", "stop") and len(choice["logprobs"]["token_logprobs"]) == 6
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["total_tokens"] > 6


def test_openai_stream_ends_with_done(live):
    with live.client() as c:
        events = sse_events(
            c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "To be", "max_tokens": 6, "temperature": 0, "stream": True},
            ).iter_lines()
        )
    assert events[-1] == "[DONE]"
    assert (
        "".join(e["choices"][0]["text"] for e in events[:-1])
        == generate(live, "To be", max_new_tokens=6)["generated_text"]
    )
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_models_info_and_health(live):
    models = httpx.get(live.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 128
    assert httpx.get(live.url + "/health").status_code == 200
    info = httpx.get(live.url + "/info").json()
    assert info["max_total_tokens"] == 128
    assert info["kernel_isa"] == (kernels.kernel_paths()["float32"] if EXACT else None)
    isa = info["kernel_isa"] or "none"
    assert live.metric("kvserve:kernel_info", kernel_isa=isa, kernels=info["kernels"], quantization="none") == 1


def test_metrics_count_tokens_and_finished_requests(live):
    before = live.metric("kvserve:generation_tokens_total", model_name="tiny")
    done_before = live.metric("kvserve:request_success_total", finished_reason="length")
    generate(live, "To be", max_new_tokens=3, ignore_eos=True)
    assert live.metric("kvserve:generation_tokens_total", model_name="tiny") == before + 3
    assert live.metric("kvserve:request_success_total", finished_reason="length") == done_before + 1
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "kvserve:time_to_first_token_seconds_bucket",
        "kvserve:inter_token_latency_seconds_count",
        "kvserve:e2e_request_latency_seconds_sum",
        "kvserve:request_queue_time_seconds_count",
        "kvserve:kv_cache_usage_perc",
        "kvserve:num_requests_waiting",
        "kvserve:prompt_tokens_total",
        "kvserve:prefix_cache_queries_total",
        "kvserve:prefix_cache_hits_total",
        "kvserve:num_preemptions_total",
    ):
        assert name in text, name


def test_metric_label_children_are_bound_once_not_per_token(live, monkeypatch):
    from prometheus_client.metrics import MetricWrapperBase

    generate(live, "To be", max_new_tokens=3)  # every child this path needs exists by now
    calls = []
    real = MetricWrapperBase.labels
    monkeypatch.setattr(MetricWrapperBase, "labels", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    stream(live, "To be", max_new_tokens=20, ignore_eos=True)
    generate(live, "To be", max_new_tokens=20, ignore_eos=True)
    assert calls == [], f"{len(calls)} label lookups for 40 tokens"


def test_a_character_split_over_byte_tokens_streams_whole(live, monkeypatch):
    """Forces the model to emit 🤖 and 世 one UTF-8 byte per token: no event may carry half a character."""

    from model.tokenizer import _unicode_to_byte

    tokenizer = live.engine.tokenizer
    byte_char = {b: c for c, b in _unicode_to_byte().items()}
    forced = [tokenizer.hf.token_to_id(byte_char[b]) for b in "🤖世".encode()]
    emitted = []

    def after(reqs, tokens):
        for row, r in enumerate(reqs):
            if r.params.seed == 4242:
                tokens[row] = forced[len(emitted)]
                emitted.append(1)

    hook_sampling(monkeypatch, after=after)
    events = stream(live, "Emoji", max_new_tokens=len(forced), do_sample=True, seed=4242)
    texts = [e["token"]["text"] for e in events]
    assert texts == ["", "", "", "🤖", "", "", "世"]
    assert events[-1]["generated_text"] == "🤖世"


def test_vanishing_temperature_and_top_p_mean_greedy(live):
    greedy = generate(live, "To be", max_new_tokens=6)["generated_text"]
    assert generate(live, "To be", max_new_tokens=6, temperature=1e-300)["generated_text"] == greedy
    assert generate(live, "To be", max_new_tokens=6, top_p=1e-300, do_sample=True)["generated_text"] == greedy


def test_stop_sequence_ends_generation_before_it(live):
    free = generate(live, "To be", max_new_tokens=30)["generated_text"]
    stop = free[4:6]
    out = generate(live, "To be", max_new_tokens=30, stop=[stop], details=True)
    assert out["generated_text"] == free[: free.find(stop)]
    assert out["details"]["finish_reason"] == "stop_sequence"


def test_sampling_without_a_seed_reports_the_one_it_drew(live):
    out = generate(live, "To be", max_new_tokens=5, do_sample=True, details=True)
    seed = out["details"]["seed"]
    assert isinstance(seed, int)
    assert (
        generate(live, "To be", max_new_tokens=5, do_sample=True, seed=seed)["generated_text"] == out["generated_text"]
    )
    assert generate(live, "To be", max_new_tokens=5, details=True)["details"]["seed"] is None


def test_a_streamed_response_closes_its_generation_on_the_event_loop_thread():
    """The Generation's cancel runs where its asyncio objects live (the cluster's client cancels tasks),
    not in a worker thread of Starlette's pool."""
    import asyncio
    import threading

    from server.api.sse import sse_response

    closed_on = []

    async def events():
        yield "data: 1\n\n"

    async def respond() -> list[dict]:
        sent = []

        async def receive() -> dict:
            await asyncio.sleep(3600)  # the client never leaves
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        response = sse_response(events(), lambda: closed_on.append(threading.current_thread()))
        await response(
            {
                "type": "http",
                "method": "GET",
                "path": "/",
                "headers": [],
                "asgi": {"version": "3.0", "spec_version": "2.3"},
            },
            receive,
            send,
        )  # uvicorn's
        return sent

    sent = asyncio.run(respond())
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b""]
    assert closed_on == [threading.current_thread()]
