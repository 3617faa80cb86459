"""Refusals and failures: 4xx with clear messages, 429 on overload, 503 while loading, disconnects and
engine errors that free their slot and leave the server serving."""

from __future__ import annotations

import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.engine import Engine
from tests.server.conftest import blocks_free, hook_sampling, pending_aborts, sse_events, wait_for

BAD_GENERATE = [
    ({"inputs": "x", "foo": 1}, "foo: Extra inputs are not permitted"),
    ({"inputs": "x", "parameters": {"bar": 1}}, "parameters.bar: Extra inputs are not permitted"),
    ({"parameters": {}}, "inputs: Field required"),
    ({"inputs": ""}, "inputs: String should have at least 1 character"),
    ({"inputs": 5}, "inputs: Input should be a valid string"),
    (
        {"inputs": "x", "parameters": {"max_new_tokens": "many"}},
        "parameters.max_new_tokens: Input should be a valid integer",
    ),
    (
        {"inputs": "x", "parameters": {"max_new_tokens": 0}},
        "parameters.max_new_tokens: Input should be greater than or equal to 1",
    ),
    ({"inputs": "x", "parameters": {"max_new_tokens": 200}}, "max_new_tokens (200) exceeds the context of 128 tokens"),
    ({"inputs": "x", "parameters": {"temperature": 0}}, "parameters.temperature: Input should be greater than 0"),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, "parameters.top_p: Input should be less than or equal to 1"),
    ({"inputs": "x", "parameters": {"top_k": 0}}, "parameters.top_k: Input should be greater than 0"),
    (
        {"inputs": "x", "parameters": {"repetition_penalty": -1}},
        "parameters.repetition_penalty: Input should be greater than 0",
    ),
    ({"inputs": "x", "parameters": {"seed": -1}}, "parameters.seed: Input should be greater than or equal to 0"),
    (
        {"inputs": "x", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
        "parameters.stop: 5 stop sequences; this server takes at most 4 (--max-stop-sequences)",
    ),
    ({"inputs": "x", "parameters": {"stop": [""]}}, "parameters.stop.0: String should have at least 1 character"),
    ({"inputs": "x", "parameters": {"best_of": 2}}, "parameters.best_of > 1 needs sampling"),
    (
        {"inputs": "x", "parameters": {"best_of": 17, "do_sample": True}},
        "parameters.best_of (17) is above this server's limit of 16 (--max-best-of)",
    ),
    (
        {"inputs": "x", "parameters": {"top_n_tokens": 21}},
        "parameters.top_n_tokens (21) is above this server's limit of 20 (--max-logprobs)",
    ),
    (
        {"inputs": "x", "parameters": {"use_cache": "sometimes"}},
        "parameters.use_cache: Input should be a valid boolean",
    ),
]


@pytest.mark.parametrize("body,message", BAD_GENERATE, ids=[m.split(":")[0][:30] for _, m in BAD_GENERATE])
def test_bad_generate_input_gets_422_naming_the_field(live, body, message):
    r = httpx.post(live.url + "/generate", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and message in r.json()["error"], r.json()


def test_a_long_prompt_is_refused_with_its_length_and_the_context(live):
    r = httpx.post(live.url + "/generate_stream", json={"inputs": "To be, " * 100}, timeout=30)
    assert r.status_code == 422 and "the context holds 128" in r.json()["error"]


def test_invalid_json_and_nan_are_422(live):
    for raw, message in (
        (b'{"inputs": ', "not valid JSON"),
        (
            b'{"inputs": "x", "parameters": {"temperature": NaN}}',
            "parameters.temperature: Input should be a finite number",
        ),
    ):
        r = httpx.post(live.url + "/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
        assert message in r.json()["error"], r.text


@pytest.mark.parametrize(
    "body,status,code,message",
    [
        ({"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "model 'gpt-4' does not exist"),
        ({"prompt": "x", "n": 17}, 400, "validation", "n (17) is above this server's limit of 16 (--max-n)"),
        (
            {"prompt": "x", "logprobs": 21},
            400,
            "validation",
            "logprobs (21) is above this server's limit of 20 (--max-logprobs)",
        ),
        ({"prompt": "x", "best_of": 1, "n": 2}, 400, "validation", "best_of (1) must be at least n (2)"),
        ({"prompt": "x", "best_of": 3, "stream": True}, 400, "validation", "best_of > n cannot be streamed"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "validation", "logit_bias: 'abc' is not a token id"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, 400, "validation", "logit_bias: '99999' is not a token id"),
        ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "validation", "logit_bias: '\u00b2' is not a token id"),
        ({"prompt": "x", "logit_bias": {"--5": 1}}, 400, "validation", "logit_bias: '--5' is not a token id"),
        ({"prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "validation", "is not a token id"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "validation",
            "stream_options is only allowed with stream: true",
        ),
        ({"prompt": "x", "logit_bias": {"3": 101}}, 400, "validation", "Input should be less than or equal to 100"),
        ({"prompt": []}, 400, "validation", "prompt"),
        ({"prompt": [1, 2, 99999]}, 400, "validation", "token ids out of range"),
        ({"prompt": "x", "max_tokens": 0}, 400, "validation", "max_tokens 0 needs echo: true"),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": 500},
            400,
            "context_length_exceeded",
            "max_tokens (500) exceeds the context of 128",
        ),
        (
            {"model": "tiny", "prompt": "x", "temperature": 3},
            400,
            "validation",
            "temperature: Input should be less than or equal to 2",
        ),
        (
            {"model": "tiny", "prompt": "x", "presence_penalty": 2.5},
            400,
            "validation",
            "presence_penalty: Input should be less than",
        ),
        ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "validation", "suffix='y' is not supported"),
    ],
)
def test_bad_completion_input_gets_its_4xx_in_openais_shape(live, body, status, code, message):
    """OpenAI's status (400 where TGI's routes answer 422), `type` and `code`, which its clients branch on."""
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == status and message in error["message"], r.text
    assert (error["type"], error["code"]) == ("invalid_request_error", code), r.text


def test_chat_top_logprobs_without_logprobs_is_400(live):
    r = httpx.post(
        live.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        timeout=30,
    )
    assert r.status_code == 400 and "top_logprobs needs logprobs: true" in r.json()["error"]["message"], r.text


def test_tgi_decoder_input_details_cannot_be_streamed(live):
    r = httpx.post(
        live.url + "/generate_stream", json={"inputs": "x", "parameters": {"decoder_input_details": True}}, timeout=30
    )
    assert r.status_code == 422 and "decoder_input_details cannot be streamed" in r.json()["error"], r.text


def test_a_prompt_error_that_is_not_about_length_counts_as_validation(live):
    before = (
        live.metric("kvserve:request_rejected_total", reason="validation"),
        live.metric("kvserve:request_rejected_total", reason="context_length"),
    )
    r = httpx.post(live.url + "/v1/completions", json={"prompt": [1, 99999], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    assert (
        live.metric("kvserve:request_rejected_total", reason="validation"),
        live.metric("kvserve:request_rejected_total", reason="context_length"),
    ) == (before[0] + 1, before[1])


def test_a_request_larger_than_the_queue_is_422_not_a_429_no_retry_could_clear(small_live):
    """2 places in all (1 running, 1 waiting): 3 copies of one prompt can never be taken."""
    r = httpx.post(
        small_live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3, "temperature": 1}, timeout=30
    )
    assert r.status_code == 400 and "holds at most 2 (--max-num-seqs + --max-waiting)" in r.json()["error"]["message"]
    assert "retry-after" not in r.headers
    ok = httpx.post(
        small_live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 2, "temperature": 1}, timeout=60
    )
    assert ok.status_code == 200, ok.text


def test_unknown_route_answers_in_the_error_shape(live):
    r = httpx.get(live.url + "/nope")
    assert r.status_code == 404 and r.json() == {"error": "Not Found", "error_type": "http"}


def test_queue_overflow_is_refused_at_once_with_429(small_live):
    engine = small_live.engine
    body = {"inputs": "To be", "parameters": {"max_new_tokens": 3}}
    rejected = small_live.metric("kvserve:request_rejected_total", reason="queue_full")
    with engine.paused():  # no step runs: requests pile up until the 1 slot + 1 waiting place are taken
        pending = [
            threading.Thread(
                target=httpx.post, args=(small_live.url + "/generate",), kwargs={"json": body, "timeout": 60}
            )
            for _ in range(2)
        ]
        for t in pending:
            t.start()
        wait_for(lambda: engine.num_waiting == 2, "two queued requests")
        r = httpx.post(small_live.url + "/generate_stream", json=body, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error_type"] == "overloaded" and "max 1" in r.json()["error"]
    for t in pending:
        t.join(60)
    assert small_live.metric("kvserve:request_rejected_total", reason="queue_full") == rejected + 1
    assert httpx.post(small_live.url + "/generate", json=body, timeout=60).status_code == 200


def test_client_disconnect_mid_stream_frees_the_slot_within_one_step(small_live):
    engine = small_live.engine
    aborted = small_live.metric("kvserve:request_success_total", finished_reason="abort")
    body = {"inputs": "To be", "parameters": {"max_new_tokens": 100, "ignore_eos": True}}
    with engine.paused():  # the test drives the steps itself
        with small_live.client() as c, c.stream("POST", "/generate_stream", json=body) as r:
            wait_for(lambda: engine.num_waiting == 1, "the request to queue")
            engine.step()  # admit + prefill: first token
            engine.step()  # second token
            first = sse_events([next(r.iter_lines())])[0]
            assert first["index"] == 1 and first["generated_text"] is None
            assert small_live.metric("kvserve:num_requests_running") == 1
            assert small_live.metric("kvserve:kv_cache_usage_perc") > 0
        wait_for(lambda: pending_aborts(engine) == 1, "the server to notice the disconnect")
        engine.step()
        assert engine.num_running == 0 and blocks_free(engine)
    assert small_live.metric("kvserve:num_requests_running") == 0
    assert small_live.metric("kvserve:kv_cache_usage_perc") == 0.0
    assert small_live.metric("kvserve:request_success_total", finished_reason="abort") == aborted + 1
    assert httpx.post(small_live.url + "/generate", json={"inputs": "To be"}, timeout=60).status_code == 200


@pytest.fixture
def sampling_breaks_on_seed_13(monkeypatch):
    """The third sampling step of any batch holding a seed-13 request raises."""
    calls = []

    def before(reqs, logits):
        if any(r.params.seed == 13 for r in reqs):
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("sampler exploded")

    hook_sampling(monkeypatch, before=before)


def test_an_engine_error_mid_stream_is_the_last_event_and_the_server_goes_on(live, sampling_breaks_on_seed_13):
    body = {"inputs": "To be", "parameters": {"max_new_tokens": 20, "seed": 13, "do_sample": True}}
    with live.client() as c:
        events = sse_events(c.post("/generate_stream", json=body).iter_lines())
    assert [e["index"] for e in events[:-1]] == [1, 2]
    assert events[-1]["error_type"] == "generation" and "sampler exploded" in events[-1]["error"]
    r = httpx.post(live.url + "/generate", json=body, timeout=60)
    assert r.status_code == 424 and "sampler exploded" in r.json()["error"]
    assert httpx.post(live.url + "/generate", json={"inputs": "To be"}, timeout=60).status_code == 200
    assert blocks_free(live.engine)


def test_health_is_503_while_loading_then_200(tiny_model, tiny_tokenizer):
    release = threading.Event()

    def slow_load() -> Engine:
        release.wait(60)
        return Engine(tiny_model, tiny_tokenizer, max_num_seqs=2)

    with TestClient(create_app(slow_load, model_name="tiny")) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"error": "the model is loading", "error_type": "unavailable"}
        assert client.post("/generate", json={"inputs": "x"}).status_code == 503
        release.set()
        wait_for(lambda: client.get("/health").status_code == 200, "the model to load")
        assert client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_health_reports_a_failed_load(tmp_path):
    def broken() -> Engine:
        raise FileNotFoundError("no weights here")

    with TestClient(create_app(broken)) as client:
        wait_for(lambda: "failed" in client.get("/health").json()["error"], "the load to fail")
        assert "no weights here" in client.get("/health").json()["error"]
