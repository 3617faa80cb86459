"""Real clients against the live server: huggingface_hub's InferenceClient and the openai package."""

from __future__ import annotations

import httpx
import pytest


def reference_text(live, prompt, n):
    return httpx.post(
        live.url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": n}}, timeout=60
    ).json()["generated_text"]


@pytest.fixture(scope="module")
def hf_client(live):
    from huggingface_hub import InferenceClient

    return InferenceClient(base_url=live.url, timeout=60)


def test_inference_client_text_generation(hf_client, live):
    text = hf_client.text_generation("To be, or not", max_new_tokens=10)
    assert text == reference_text(live, "To be, or not", 10)


def test_inference_client_text_generation_with_details(hf_client, live):
    out = hf_client.text_generation("To be, or not", max_new_tokens=10, details=True)
    assert out.generated_text == reference_text(live, "To be, or not", 10)
    assert out.details.generated_tokens == len(out.details.tokens) and out.details.finish_reason in (
        "length",
        "eos_token",
    )


def test_inference_client_streams(hf_client, live):
    pieces = list(hf_client.text_generation("世界你好", max_new_tokens=10, stream=True))
    assert "".join(pieces) == reference_text(live, "世界你好", 10)


def test_inference_client_streams_with_details(hf_client, live):
    events = list(
        hf_client.text_generation("To be", max_new_tokens=8, stream=True, details=True, seed=5, do_sample=True)
    )
    assert events[-1].generated_text == "".join(e.token.text for e in events)
    assert events[-1].details.generated_tokens == len(events) and events[-1].details.seed == 5


def test_openai_client_streams_a_completion(live):
    from openai import OpenAI

    client = OpenAI(
        base_url=live.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )
    assert [m.id for m in client.models.list()] == ["tiny"]
    chunks = list(client.completions.create(model="tiny", prompt="To be", max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference_text(live, "To be", 10)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    whole = client.completions.create(model="tiny", prompt="To be", max_tokens=10, temperature=0)
    assert whole.choices[0].text == reference_text(live, "To be", 10) and whole.usage.completion_tokens <= 10
