"""What text and JSON the server takes at the door, the same on every route family: a string that is not
Unicode (a lone UTF-16 surrogate) is invalid input naming its field, and so is JSON nested past what the
parser reads; each in its family's shape and status (TGI's 422, OpenAI's and vLLM's tokenizer routes' 400)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.server.conftest import serve

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
LONE = "a\ud800b"  # what JSON's "a\ud800b" decodes to: a high surrogate with no low one after it
USER = {"role": "user", "content": LONE}
PART = {"role": "user", "content": [{"type": "text", "text": LONE}]}

# (route, body, the field the refusal names)
TEXT_FIELDS = [
    ("/generate", {"inputs": LONE}, "inputs"),
    ("/generate_stream", {"inputs": LONE}, "inputs"),
    ("/", {"inputs": LONE, "stream": True}, "inputs"),
    ("/generate", {"inputs": "x", "parameters": {"stop": ["ok", LONE]}}, "parameters.stop.1"),
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", LONE], "max_tokens": 2, "stream": True}, "prompt.1"),
    ("/v1/completions", {"prompt": "x", "stop": LONE, "max_tokens": 2}, "stop"),
    ("/v1/completions", {"prompt": "x", "user": LONE, "max_tokens": 2}, "user"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {LONE: 1}, "max_tokens": 2}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 2}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 2, "stream": True}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [PART], "max_tokens": 2}, "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [PART], "max_tokens": 2, "stream": True}, "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{**USER, "content": "x", "name": LONE}]}, "messages.0.name"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [USER]}, "messages.0.content"),
    ("/tokenize", {"messages": [PART]}, "messages.0.content.0.text"),
    ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
]
ROUTES = ["/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, tiny_checkpoint):
    """The tiny model with a chat template, so that chat messages reach the tokenizer."""
    directory = tmp_path_factory.mktemp("chat-ckpt")
    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, directory / f.name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    server = serve(directory, max_num_seqs=4)
    yield server
    server.stop()


def post_raw(server, route: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=60)


def assert_invalid_input(r: httpx.Response, route: str, message: str) -> None:
    """TGI's routes answer 422 {"error", "error_type": "validation"}; the others OpenAI's 400 with code validation."""
    if route.startswith("/v1/") or route in ("/tokenize", "/detokenize"):
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
        assert error["code"] == "validation" and message in error["message"], r.text
    else:
        assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
        assert message in r.json()["error"], r.text


@pytest.mark.parametrize("route,body,field", TEXT_FIELDS, ids=[f"{r}:{f}" for r, _, f in TEXT_FIELDS])
def test_a_lone_surrogate_is_invalid_input_naming_its_field(chat_server, route, body, field):
    raw = json.dumps(body).encode()  # ASCII: the surrogate travels as the escape \ud800
    assert b"\\ud800" in raw
    r = post_raw(chat_server, route, raw)
    assert_invalid_input(r, route, f"{field}: a string holds a lone UTF-16 surrogate (\\ud800) at character 1")


def test_a_surrogate_sent_as_raw_bytes_is_refused_as_its_escape_is(chat_server):
    """JSON's decoder lets the three bytes of an encoded surrogate through as one: the same refusal."""
    raw = b'{"prompt": "a\xed\xa0\x80b"}'
    r = post_raw(chat_server, "/tokenize", raw)
    assert_invalid_input(r, "/tokenize", "prompt: a string holds a lone UTF-16 surrogate (\\ud800) at character 1")


def test_a_surrogate_pair_is_one_character_and_is_taken(chat_server):
    """\\ud83d\\ude00 is JSON's way to write one character beyond the 16-bit range: text, not refused."""
    pair = json.dumps({"prompt": "a\U0001f600"}).encode()
    assert b"\\ud83d\\ude00" in pair
    tokenized = post_raw(chat_server, "/tokenize", pair)
    assert tokenized.status_code == 200, tokenized.text
    chat = {"messages": [{"role": "user", "content": "a\U0001f600"}], "max_tokens": 2}
    assert post_raw(chat_server, "/v1/chat/completions", json.dumps(chat).encode()).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_json_nested_past_the_parser_is_invalid_input_on_every_route(chat_server, route, depth):
    """Unclosed or closed, arrays nested deeper than the parser reads are invalid JSON input as a syntax
    error is (422, OpenAI's 400), not the 400 of a body that is not UTF-8."""
    for raw in (b"[" * depth, b"[" * depth + b"]" * depth, b'{"inputs": ' + b"[" * depth):
        assert_invalid_input(post_raw(chat_server, route, raw), route, "nest too deeply")
    assert_invalid_input(post_raw(chat_server, route, b"[" * 10), route, "the body is not valid JSON")


def test_a_body_that_is_not_utf8_stays_400(chat_server):
    r = post_raw(chat_server, "/generate", b'{"inputs": "\xff\xfe"}')
    assert r.status_code == 400, r.text
