"""What crosses Ray between the ingress and a replica: one typed object each way."""
from __future__ import annotations

from dataclasses import dataclass

from model.sampling import SamplingParams


@dataclass(frozen=True)
class Submission:
    """One prompt for a replica, with its copies (OpenAI's n and best_of share its blocks there)."""

    request_ids: list[str]  # the ingress's id of each copy: the replica's events carry them
    prompt_ids: list[int]  # the prompt's token ids (the router reads them to choose the replica)
    params: list[SamplingParams]  # one per copy
    use_cache: bool  # False: computed without the prefix cache
    cache_salt: str | None  # the prefix-cache namespace (None: the shared one)
    speculative: bool = True  # False: no speculative decoding for it (the output is the same either way)
