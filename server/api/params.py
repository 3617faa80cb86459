"""Sampling parameters from a request's fields, shared by the TGI and OpenAI routes."""

from __future__ import annotations

import re

from model.sampling import SAMPLING_EPS, SamplingError, SamplingParams
from server.api.errors import APIError

TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")  # a logit_bias key that int() reads as a token id (or a negative one)


def sampling_params(vocab_size: int, **kw) -> SamplingParams:
    """SamplingParams from a request's fields. Also folds values out of the sampler's range into their
    limit, as vLLM does, unchanged in meaning: a temperature below SAMPLING_EPS is greedy, a top_p below
    it keeps the best token only, a top_k above the vocabulary keeps every token, and a repetition
    penalty beyond [SAMPLING_EPS, 1/SAMPLING_EPS] (which would overflow float32 logits to inf) is held
    at that bound, where it already decides alone."""
    if 0 < kw["temperature"] < SAMPLING_EPS:
        kw["temperature"] = 0.0
    kw["top_p"] = max(kw["top_p"], SAMPLING_EPS)
    kw["top_k"] = min(kw["top_k"], vocab_size)
    kw["repetition_penalty"] = min(max(kw["repetition_penalty"], SAMPLING_EPS), 1 / SAMPLING_EPS)
    try:
        return SamplingParams(**kw)
    except SamplingError as e:
        raise APIError(422, str(e), "validation") from e


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int, field: str = "logit_bias") -> tuple:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id is a 422."""
    pairs = []
    for key, value in (bias or {}).items():
        # ASCII digits only, and few of them: int() takes "²" too, and refuses "--5" and 5,000 digits by raising
        if not TOKEN_ID_KEY.fullmatch(key) or not 0 <= int(key) < vocab_size:
            raise APIError(422, f"{field}: {key!r} is not a token id in [0, {vocab_size})", "validation")
        pairs.append((int(key), float(value)))
    return tuple(pairs)
