"""The API key, CORS and the body-size limit: who gets in, and what is refused before any route runs."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import serve

KEY = "s3cret-key"
ORIGIN = "http://ui.example"
PROTECTED = [
    ("GET", "/info"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/"),
    ("POST", "/v1/completions"),
    ("GET", "/nope"),
]
WRONG_AUTH = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": "Bearer"},
]
TINY_BODY = {"inputs": "To be", "parameters": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint):
    server = serve(tiny_checkpoint, app_kw={"api_key": KEY, "cors_origins": [ORIGIN]}, max_num_seqs=2, max_waiting=4)
    yield server
    server.stop()


@pytest.mark.parametrize("method,path", PROTECTED)
def test_every_protected_route_refuses_a_missing_or_wrong_key_with_401(keyed, method, path):
    for headers in WRONG_AUTH:
        r = httpx.request(method, keyed.url + path, json=TINY_BODY, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        if path.startswith("/v1/"):  # OpenAI's shape, which its clients read
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key", r.text
            assert "Bearer" in error["message"]
        else:
            assert r.json()["error_type"] == "unauthorized" and "Bearer" in r.json()["error"]
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_right_key_opens_every_route(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    with keyed.client(headers=auth) as c:
        assert c.get("/info").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 200
        assert c.post("/generate", json=TINY_BODY).status_code == 200
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert c.get("/nope").status_code == 404
    with keyed.client(headers={"Authorization": f"bearer {KEY}"}) as c:  # the scheme is case-insensitive
        assert c.get("/info").status_code == 200


def test_health_and_the_playground_page_stay_open_without_the_key(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/").status_code == 200
    assert httpx.get(keyed.url + "/static/app.js").status_code == 200
    assert httpx.post(keyed.url + "/static/app.js").status_code == 401  # only GET / HEAD of the page are public


def test_refused_keys_are_counted_by_reason(keyed):
    def unauthorized() -> float:
        text = httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        line = next(
            ln
            for ln in text.splitlines()
            if ln.startswith("kvserve:request_rejected_total{") and 'reason="unauthorized"' in ln
        )
        return float(line.rsplit(" ", 1)[1])

    httpx.get(keyed.url + "/info")
    before = unauthorized()
    httpx.get(keyed.url + "/info", headers={"Authorization": "Bearer nope"})
    assert unauthorized() == before + 1


def test_a_huge_body_without_the_key_is_refused_before_it_is_read(keyed):
    r = httpx.post(keyed.url + "/generate", content=b"x" * 10_000_000, headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_cors_allows_the_configured_origin_only(keyed):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(keyed.url + "/generate", headers={"Origin": ORIGIN, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(keyed.url + "/generate", headers={"Origin": "http://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(keyed.url + "/info", headers={"Origin": ORIGIN})  # a refusal still tells the page why
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_is_off_by_default(live):
    r = httpx.get(live.url + "/health", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(live.url + "/generate", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_a_body_over_the_limit_is_413_with_or_without_content_length(live):
    rejected = live.metric("kvserve:request_rejected_total", reason="body_too_large")
    big = b'{"inputs": "' + b"a" * 10_000_000 + b'"}'
    r = httpx.post(live.url + "/generate", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error_type"] == "body_too_large", r.text
    assert "2000000 bytes (--max-body-bytes)" in r.json()["error"]

    def chunked():  # a generator body goes out with Transfer-Encoding: chunked, no Content-Length
        for _ in range(100):
            yield b"a" * 100_000

    r = httpx.post(live.url + "/generate", content=chunked(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error_type"] == "body_too_large"
    r = httpx.post(live.url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert live.metric("kvserve:request_rejected_total", reason="body_too_large") == rejected + 3
    assert httpx.post(live.url + "/generate", json=TINY_BODY, timeout=60).status_code == 200


def test_a_chunked_body_under_the_limit_is_served(live):
    def chunked():
        yield b'{"inputs": "To be", '
        yield b'"parameters": {"max_new_tokens": 2}}'

    r = httpx.post(live.url + "/generate", content=chunked(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200 and "generated_text" in r.json()
