"""The trained checkpoint served end to end: the text a client reads is the reference `generate`'s."""

from __future__ import annotations

import httpx
import pytest

from model.generate import generate
from model.sampling import SamplingParams
from tests.server.conftest import serve, sse_events

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!"]


@pytest.fixture(scope="module")
def default_live(default_checkpoint):
    server = serve(default_checkpoint, max_num_seqs=4, max_waiting=4)
    yield server
    server.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_served_greedy_text_is_the_reference_generate(default_live, default_model, default_tokenizer, prompt):
    expected = "".join(
        s.text
        for s in generate(default_model, default_tokenizer, prompt, SamplingParams(max_new_tokens=40, temperature=0))
    )
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 40}}
    for use_cache in (True, False):
        body["parameters"]["use_cache"] = use_cache
        r = httpx.post(default_live.url + "/generate", json=body, timeout=120)
        assert r.json()["generated_text"] == expected, f"use_cache={use_cache}"
    with default_live.client() as c:
        events = sse_events(c.post("/generate_stream", json=body).iter_lines())
    assert "".join(e["token"]["text"] for e in events) == expected
    assert "\ufffd" not in expected
