"""A request's seed as the API reports it, and the seeds of its copies (n, best_of). The rules themselves
(how a seed is drawn, how a copy's is derived) live in model.sampling."""

from __future__ import annotations

from dataclasses import replace

from model.sampling import SamplingParams, copy_seed, resolve_seed


def seed_for(sampling: bool, seed: int | None) -> int | None:
    """A sampled request without a seed gets a random one, reported back so it can be replayed; a greedy
    one keeps what it gave (None included)."""
    return resolve_seed(seed) if sampling else seed


def copies_of(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n requests of one prompt: copy i > 0 samples with a seed derived from the first's (greedy copies
    are alike anyway), so n copies give n samples, and the same n again for the same seed."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [params] + [replace(params, seed=copy_seed(params.seed, i)) for i in range(1, n)]
