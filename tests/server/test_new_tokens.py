"""How many tokens a request generates when it does not say: one rule (Limits.new_tokens) for every route,
each with its own default (TGI's 100, OpenAI completions' 16, none for chat), cut to what the context leaves
and to --max-new-tokens."""

from __future__ import annotations

import httpx
import pytest

from server.api.errors import APIError
from server.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS, TGI_DEFAULT_MAX_NEW_TOKENS, Limits

CONTEXT = 128


@pytest.mark.parametrize(
    "default, prompt_len, limit, expected",
    [
        (TGI_DEFAULT_MAX_NEW_TOKENS, 10, None, 100),
        (TGI_DEFAULT_MAX_NEW_TOKENS, 100, None, 28),  # what the context leaves
        (TGI_DEFAULT_MAX_NEW_TOKENS, 10, 50, 50),  # --max-new-tokens
        (COMPLETIONS_DEFAULT_MAX_TOKENS, 10, None, 16),
        (COMPLETIONS_DEFAULT_MAX_TOKENS, 10, 5, 5),
        (COMPLETIONS_DEFAULT_MAX_TOKENS, 124, None, 4),  # was 16: a 400 for a number the client never sent
        (None, 10, None, 118),  # chat: what the context leaves
        (None, 10, 50, 50),
        (None, 128, None, 1),  # at least 1: the engine refuses the prompt for its own length
    ],
)
def test_a_missing_max_new_tokens_is_the_routes_default_cut_to_the_context_and_the_limit(
    default, prompt_len, limit, expected
):
    limits = Limits(max_new_tokens=limit)
    got = limits.new_tokens(None, "max_tokens", prompt_len=prompt_len, context_length=CONTEXT, default=default)
    assert got == expected


def test_a_max_new_tokens_asked_for_is_kept_and_checked_against_the_limit():
    limits = Limits(max_new_tokens=50)
    assert limits.new_tokens(0, "max_tokens", prompt_len=10, context_length=CONTEXT, default=16) == 0
    assert limits.new_tokens(40, "max_tokens", prompt_len=100, context_length=CONTEXT, default=16) == 40
    with pytest.raises(APIError, match=r"max_tokens \(60\) is above this server's limit of 50 \(--max-new-tokens\)"):
        limits.new_tokens(60, "max_tokens", prompt_len=10, context_length=CONTEXT, default=16)


def test_a_completion_near_the_end_of_the_context_generates_what_is_left_by_default(live):
    """Without max_tokens, a prompt 4 tokens short of the context got a 400 (16 new tokens did not fit);
    TGI's and chat's defaults were already cut to what the context leaves."""
    body = {"prompt": [5] * (CONTEXT - 4), "temperature": 0, "ignore_eos": True}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert (choice["finish_reason"], usage["completion_tokens"]) == ("length", 4)
