"""Distributions of the engine's steps: how long each took and how many tokens it computed, decode
and prompt apart. The engine fills them; /metrics reads them at scrape time (no HTTP code here)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from server.engine.step_budget import StepWork

STEP_SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
STEP_TOKENS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class HistogramSnapshot:
    """A histogram's state, as Prometheus wants it."""

    buckets: tuple[float, ...]  # upper bounds, ascending (+Inf implied after the last)
    counts: list[int]  # per bucket, not cumulative; one more than `buckets` (the +Inf bucket)
    total: float  # sum of the observed values
    count: int  # number of observations

    @classmethod
    def from_dict(cls, fields: dict) -> HistogramSnapshot:
        """One from `dataclasses.asdict`'s form, by field name (the sequences back to their types)."""
        return cls(**{**fields, "buckets": tuple(fields["buckets"]), "counts": list(fields["counts"])})

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum, self._count = 0.0, 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, list(self._counts), self._sum, self._count)


@dataclass
class StepStatsSnapshot:
    step_seconds: HistogramSnapshot  # wall time of each step's forward and sampling
    decode_tokens: HistogramSnapshot  # decode rows per step (one token each)
    prompt_tokens: HistogramSnapshot  # prompt-chunk and recompute tokens per step
    target_step_s: float | None  # the time target in force (--target-step-ms), None when off
    max_batched_tokens: int  # the token cap of a step (--max-num-batched-tokens)
    prompt_allowance: int  # prompt tokens the latest step was allowed

    @classmethod
    def from_dict(cls, fields: dict) -> StepStatsSnapshot:
        """One from `dataclasses.asdict`'s form (a replica's report to Ray Serve carries it so), by field
        name: the histograms are the fields that arrive as dicts."""
        return cls(**{name: HistogramSnapshot.from_dict(v) if isinstance(v, dict) else v for name, v in fields.items()})


def merged(
    snapshots: list[StepStatsSnapshot], target_step_s: float | None, max_batched_tokens: int
) -> StepStatsSnapshot:
    """Several engines' steps as one (a cluster's replicas): each histogram summed bucket by bucket, the
    prompt allowances summed; the budget's settings, which every replica shares, as given (from the first
    snapshot, if any)."""
    if snapshots:
        target_step_s, max_batched_tokens = snapshots[0].target_step_s, snapshots[0].max_batched_tokens

    def summed(name: str, buckets: tuple[float, ...]) -> HistogramSnapshot:
        parts = [getattr(s, name) for s in snapshots]
        counts = [sum(column) for column in zip(*(p.counts for p in parts))] or [0] * (len(buckets) + 1)
        return HistogramSnapshot(buckets, counts, sum(p.total for p in parts), sum(p.count for p in parts))

    return StepStatsSnapshot(
        summed("step_seconds", STEP_SECONDS_BUCKETS),
        summed("decode_tokens", STEP_TOKENS_BUCKETS),
        summed("prompt_tokens", STEP_TOKENS_BUCKETS),
        target_step_s,
        max_batched_tokens,
        sum(s.prompt_allowance for s in snapshots),
    )


class StepStats:
    """Filled on the engine thread, read from a scrape: one lock around both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step_seconds = Histogram(STEP_SECONDS_BUCKETS)
        self.decode_tokens = Histogram(STEP_TOKENS_BUCKETS)
        self.prompt_tokens = Histogram(STEP_TOKENS_BUCKETS)

    def observe(self, work: StepWork, seconds: float) -> None:
        with self._lock:
            self.step_seconds.observe(seconds)
            self.decode_tokens.observe(work.decode_rows)
            self.prompt_tokens.observe(work.prompt_tokens)

    def snapshot(
        self, target_step_s: float | None, max_batched_tokens: int, prompt_allowance: int
    ) -> StepStatsSnapshot:
        with self._lock:
            return StepStatsSnapshot(
                self.step_seconds.snapshot(),
                self.decode_tokens.snapshot(),
                self.prompt_tokens.snapshot(),
                target_step_s,
                max_batched_tokens,
                prompt_allowance,
            )
