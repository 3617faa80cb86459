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
    ingress_id: str | None = None  # the ingress whose feed from this replica may carry its events
    dead_feeds: tuple[str, ...] = ()  # feeds that ingress saw break lately: a replica still holding one closes it


@dataclass(frozen=True)
class Taken:
    """A replica's first answer to a call sent with an `ingress_id`: its engine took the prompt. The
    events then come on that ingress's feed `feed_id` from this replica, or on the call itself when
    `feed_id` is None (no feed of that ingress is attached there)."""

    replica_id: str
    feed_id: str | None


@dataclass(frozen=True)
class FeedRequest:
    """An ingress's call to one replica for the events of all its requests there, one stream item per
    engine step (replica.py). `feed_id` is new for every such call; the request router sends it to
    `replica_id` (ray_router.py)."""

    ingress_id: str
    replica_id: str
    feed_id: str


class FeedEnded(RuntimeError):
    """A replica's answer to a call whose request was on a feed that ended before it did (the replica
    aborted it): nothing of it reached the ingress that the ingress can trust to be complete."""
