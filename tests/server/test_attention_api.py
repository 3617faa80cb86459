"""`parameters.return_attention` against a live server: the weights returned are the model's own."""

from __future__ import annotations

import httpx
import pytest
import torch

from model.attention import attention_weights
from server.engine.attention_rows import ATTENTION_DECIMALS, MAX_ATTENTION_QUERIES
from tests.server.conftest import ingress_without_replicas, sse_events

PROMPT = "To be, or not to be, that is the question"
ROUNDING = 0.5 * 10**-ATTENTION_DECIMALS  # the most one rounded weight may differ from the exact one


def post_generate(live, **parameters) -> dict:
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference_rows(live, ids: list[int], query_start: int) -> torch.Tensor:
    """The model's weights for the same ids, computed directly (no step runs meanwhile)."""
    with live.engine.paused():
        return attention_weights(live.engine.model, ids)[:, :, query_start:]  # (L, nh, Q, K)


@pytest.mark.parametrize("use_cache", [True, False])
def test_returned_weights_equal_the_models_for_prompt_and_generated_ids(live, use_cache):
    out = post_generate(live, max_new_tokens=12, return_attention=True, use_cache=use_cache)
    details, attention = out["details"], out["details"]["attention"]
    prompt_ids = live.engine.tokenizer.encode(PROMPT)
    generated_ids = [t["id"] for t in details["tokens"]]
    ids = prompt_ids + generated_ids
    config = live.engine.model_config

    weights = torch.tensor(attention["weights"])  # (L, nh, Q, K)
    assert attention["query_start"] == len(prompt_ids)
    assert (attention["layers"], attention["heads"]) == (config.n_layer, config.n_head)
    assert weights.shape == (config.n_layer, config.n_head, len(generated_ids), len(ids))
    assert attention["tokens"] == [live.engine.tokenizer.decode([i]) for i in ids]
    assert "".join(attention["tokens"][: len(prompt_ids)]) == PROMPT

    num_keys = weights.shape[-1]
    row_sums = weights.sum(-1)
    assert (row_sums - 1).abs().max() <= num_keys * ROUNDING, f"rows do not sum to 1: {row_sums}"
    positions = torch.arange(num_keys)
    query_positions = len(prompt_ids) + torch.arange(len(generated_ids))
    future = positions[None, :] > query_positions[:, None]  # (Q, K)
    assert (weights[:, :, future] == 0).all(), "a generated token attended to a later position"

    expected = reference_rows(live, ids, len(prompt_ids))
    torch.testing.assert_close(
        weights,
        expected,
        atol=ROUNDING + 1e-6,
        rtol=0,
        msg=lambda m: f"API weights differ from model.attention.attention_weights: {m}",
    )


def test_stream_carries_the_same_weights_in_its_last_event(live):
    parameters = dict(max_new_tokens=10, return_attention=True)
    whole = post_generate(live, **parameters)["details"]["attention"]
    with (
        live.client() as c,
        c.stream("POST", "/generate_stream", json={"inputs": PROMPT, "parameters": parameters}) as r,
    ):
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert all(e["details"] is None for e in events[:-1]), "attention sent before the last event"
    assert events[-1]["details"]["attention"] == whole


def test_weights_are_returned_for_at_most_the_first_64_generated_tokens(live):
    out = post_generate(
        live, max_new_tokens=MAX_ATTENTION_QUERIES + 16, return_attention=True, stop=[], do_sample=True, seed=1
    )
    attention, prompt_len = out["details"]["attention"], len(live.engine.tokenizer.encode(PROMPT))
    assert out["details"]["generated_tokens"] > MAX_ATTENTION_QUERIES, "the seed should not stop early"
    weights = torch.tensor(attention["weights"], dtype=torch.float64)
    assert weights.shape[2:] == (MAX_ATTENTION_QUERIES, prompt_len + MAX_ATTENTION_QUERIES)
    assert len(attention["tokens"]) == prompt_len + MAX_ATTENTION_QUERIES
    sent = [w for row in attention["weights"][0][0] for w in row]
    assert all(round(w, ATTENTION_DECIMALS) == w for w in sent), "weights are not rounded to 4 decimals"


def test_attention_is_absent_unless_asked_for(live):
    out = post_generate(live, max_new_tokens=4, details=True)
    assert out["details"].get("attention") is None
    assert "details" not in post_generate(live, max_new_tokens=4)


def test_return_attention_turns_details_on(live):
    out = post_generate(live, max_new_tokens=4, return_attention=True)
    assert (
        out["details"]["generated_tokens"] == len(out["details"]["tokens"]) == 4
        or out["details"]["finish_reason"] == "eos_token"
    )
    assert out["details"]["attention"]["query_start"] == out["details"]["input_length"]


def test_work_run_between_steps_hands_back_its_error_and_the_engine_keeps_serving(live):
    failing = live.engine.run_between_steps(lambda: 1 / 0)
    assert isinstance(failing.exception(timeout=60), ZeroDivisionError)
    assert live.engine.run_between_steps(lambda: "done").result(timeout=60) == "done"
    assert post_generate(live, max_new_tokens=3)["generated_text"] is not None


def test_the_payload_is_built_off_the_event_loop(live, monkeypatch):
    import asyncio
    import threading

    import server.api.attention_view as view

    threads, real = [], view._payload

    def recording(*args):
        threads.append(threading.current_thread())
        try:  # no event loop runs in this thread (uvicorn's runs in a thread of its own here, not the main one)
            asyncio.get_running_loop()
            threads.append("on a running event loop")
        except RuntimeError:
            pass
        return real(*args)

    monkeypatch.setattr(view, "_payload", recording)
    post_generate(live, max_new_tokens=4, return_attention=True)
    assert len(threads) == 1, threads
    assert threads[0] is not threading.main_thread() and threads[0].name != "kvserve-engine", threads[0].name


def test_return_attention_behind_the_cluster_ingress_is_refused_before_it_generates(tiny_checkpoint):
    with ingress_without_replicas(tiny_checkpoint) as http:
        r = http.post("/generate", json={"inputs": PROMPT, "parameters": {"return_attention": True}})
    assert r.status_code == 422 and r.json() == {
        "error": "parameters.return_attention needs the model in this process (python -m server), not behind the "
        "cluster's ingress",
        "error_type": "validation",
    }
