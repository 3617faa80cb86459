"""What real clients send and operators expect: chat content as a list of parts, a client's
placeholder model name, several served names, vLLM's tokenizer routes (as lm-eval's remote tokenizer
calls them), usage in every streamed chunk, logprobs 0, and the browser's favicon request."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.server.conftest import serve, sse_events

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
NAMES = ["tiny", "tiny-alias"]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, tiny_checkpoint):
    """The tiny model with a chat template, served under two names."""
    directory = tmp_path_factory.mktemp("chat-ckpt")
    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, directory / f.name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    server = serve(directory, app_kw={"model_name": NAMES}, max_num_seqs=4)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(chat_server):
    with chat_server.client() as client:
        yield client


def openai_client(server):
    from openai import OpenAI

    return OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


# ---- chat content as parts -------------------------------------------------------------------------


def test_chat_text_parts_are_joined_by_newlines_as_one_string_would_be(chat_server):
    client = openai_client(chat_server)
    parts = [{"type": "text", "text": "To be,"}, {"type": "text", "text": "or not to be?"}]
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0
    )
    as_string = client.chat.completions.create(
        model="tiny", max_tokens=6, temperature=0, messages=[{"role": "user", "content": "To be,\nor not to be?"}]
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_a_chat_part_that_is_not_text_is_a_400_naming_its_type(http):
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400, r.text
    assert "'image_url'" in r.json()["error"]["message"] and "text only" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert r.status_code == 400 and "needs a 'text' string" in r.json()["error"]["message"], r.text


# ---- model names -----------------------------------------------------------------------------------


def test_huggingface_hub_chat_completion_works_unchanged(chat_server):
    """InferenceClient(base_url=...) sends the placeholder model 'dummy' when given none."""
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=chat_server.url, timeout=60)
    out = client.chat_completion([{"role": "user", "content": "To be?"}], max_tokens=4, temperature=0)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
    assert out.model == "tiny"


def test_a_wrong_model_name_is_still_a_404_and_every_served_name_is_served(chat_server, http):
    from openai import NotFoundError

    client = openai_client(chat_server)
    with pytest.raises(NotFoundError, match="'tiny-typo' does not exist; this server serves 'tiny', 'tiny-alias'"):
        client.completions.create(model="tiny-typo", prompt="To be", max_tokens=2)
    for name in NAMES:
        out = client.completions.create(model=name, prompt="To be", max_tokens=2, temperature=0)
        assert out.model == "tiny"  # answers report the first name, as vLLM
    assert [m.id for m in client.models.list().data] == NAMES
    r = http.post("/tokenize", json={"model": "tiny-typo", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


# ---- tokenizer routes ------------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip_as_the_engine_tokenizes(chat_server, http):
    text = "To be, or not to be: 世界 🤖"
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = chat_server.engine.tokenizer.encode(text)
    assert body["tokens"] == expected and body["count"] == len(expected) and body["max_model_len"] == 128
    assert body["token_strs"] == [chat_server.engine.tokenizer.hf.id_to_token(t) for t in expected]
    r = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    r = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"], r.text


def test_tokenize_messages_gives_the_prompt_chat_completions_runs(http):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "To be?"}]},
    ]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    rendered = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert rendered == "<system>Be brief.\n<user>To be?\n<assistant>"
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    r = http.post("/tokenize", json={"prompt": "x", "messages": messages})
    assert r.status_code == 400 and "exactly one of prompt and messages" in r.json()["error"]["message"]


def test_tokenizer_info_serves_what_lm_evals_remote_tokenizer_reads(chat_server, http):
    """lm-eval probes GET /tokenizer_info for eos_token, then finds the EOS id by POST /tokenize."""
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == 128 and info["vocab_size"] == chat_server.engine.tokenizer.vocab_size
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [chat_server.engine.tokenizer.eos_token_id]


# ---- usage in every chunk --------------------------------------------------------------------------


def _stream(http, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "To be, or not", "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "To be?"}],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
        ),
    ],
)
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(http, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = [e for e in _stream(http, path, {**body, "stream_options": options}) if e != "[DONE]"]
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    chunks = events[:-1]
    assert chunks and all(c["usage"] is not None for c in chunks), chunks
    prompt_tokens = {c["usage"]["prompt_tokens"] for c in chunks}
    assert prompt_tokens == {final["usage"]["prompt_tokens"]}
    generated = [c["usage"]["completion_tokens"] for c in chunks]
    assert generated == sorted(generated) and generated[-1] == 6
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks
    )
    plain = [e for e in _stream(http, path, {**body, "stream_options": {"include_usage": True}}) if e != "[DONE]"]
    assert all("usage" not in c or c["usage"] is None for c in plain[:-1])


def test_continuous_usage_stats_without_include_usage_is_refused_not_ignored(http):
    r = http.post(
        "/v1/completions", json={"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    assert r.status_code == 400 and "needs stream_options.include_usage" in r.json()["error"]["message"], r.text


# ---- logprobs 0 ------------------------------------------------------------------------------------


def test_logprobs_0_gives_each_chosen_tokens_own_entry_as_vllm(http):
    body = {"prompt": "To be, or not", "max_tokens": 5, "temperature": 0, "logprobs": 0}
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{t: lp} for t, lp in zip(logprobs["tokens"], logprobs["token_logprobs"])]
    streamed = [e for e in _stream(http, "/v1/completions", body) if e != "[DONE]" and e["choices"]]
    assert [top for e in streamed for top in e["choices"][0]["logprobs"]["top_logprobs"]] == [
        {t: lp} for t, lp in zip(logprobs["tokens"], logprobs["token_logprobs"]) if t
    ]
    echo = http.post("/v1/completions", json={**body, "max_tokens": 0, "echo": True}).json()["choices"][0]["logprobs"]
    assert echo["top_logprobs"][0] is None
    assert echo["top_logprobs"][1:] == [{t: lp} for t, lp in zip(echo["tokens"][1:], echo["token_logprobs"][1:])]


# ---- the browser -----------------------------------------------------------------------------------


def test_the_favicon_is_served_without_the_api_key(tiny_checkpoint):
    server = serve(tiny_checkpoint, app_kw={"api_key": "secret"}, max_num_seqs=1)
    try:
        r = httpx.get(server.url + "/favicon.ico", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml"), r.text
        assert httpx.get(server.url + "/tokenizer_info", timeout=30).status_code == 401
    finally:
        server.stop()
