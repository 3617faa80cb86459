"""The engine's running totals, as one typed object: the engine takes it (`Engine.counters`), a cluster's
ingress sums its replicas' (`EngineCounters.summed`), and /metrics exports each field as a Prometheus
counter (server/api/metrics.py, under vLLM's names). A field is named here once; everything else reads
it as an attribute, so a misspelt name is an error, not a metric left out."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Speculative decoding's totals since start (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # verifications of a draft
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: drafts whose token i was accepted

    @classmethod
    def from_dict(cls, fields: dict) -> SpecDecodeCounters:
        """One from `dataclasses.asdict`'s form, by field name."""
        return cls(**{**fields, "num_accepted_tokens_per_pos": tuple(fields["num_accepted_tokens_per_pos"])})


@dataclass(frozen=True)
class StructuredOutputCounters:
    """Structured output's totals since start: requests under a grammar, their masks, grammar compiles."""

    requests: int = 0  # requests taken with a grammar (a JSON schema, regex, choice, EBNF, or a forced tool call)
    mask_rows: int = 0  # rows whose pick a grammar restricted (speculative drafts' rows included)
    mask_seconds: float = 0.0  # time the engine spent filling those masks, before each step's forward
    grammar_compiles: int = 0  # grammars compiled (cache misses), the API's checks at the door included
    grammar_compile_seconds: float = 0.0  # time spent compiling them
    grammar_cache_hits: int = 0  # grammars found compiled


@dataclass(frozen=True)
class EngineCounters:
    """The engine's totals since start, read when /metrics is scraped."""

    prefix_cache_queries: int = 0  # prompt tokens of admitted requests that used the cache
    prefix_cache_hits: int = 0  # of those, tokens served from the prefix cache
    num_preemptions: int = 0  # requests preempted (blocks freed, recomputed later)
    spec_decode: SpecDecodeCounters | None = None  # None: the engine does not speculate
    structured_output: StructuredOutputCounters = StructuredOutputCounters()

    @classmethod
    def from_dict(cls, fields: dict) -> EngineCounters:
        """One from `dataclasses.asdict`'s form, by field name (a replica's report carries it so)."""
        spec, structured = fields.get("spec_decode"), fields.get("structured_output")
        return cls(
            **{
                **fields,
                "spec_decode": None if spec is None else SpecDecodeCounters.from_dict(spec),
                "structured_output": StructuredOutputCounters(**(structured or {})),
            }
        )

    @classmethod
    def summed(cls, parts: Sequence[EngineCounters]) -> EngineCounters:
        """Several engines' totals as one (a cluster's replicas), field by field; spec-decode totals when
        any of them speculates."""
        return _summed(list(parts)) or cls()


def _summed(values: list):
    """The sum of one field over several counters: numbers added, per-position tuples added position by
    position, nested counters field by field; None where every value is None."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if dataclasses.is_dataclass(first):
        return type(first)(
            **{f.name: _summed([getattr(v, f.name) for v in present]) for f in dataclasses.fields(first)}
        )
    if isinstance(first, tuple):
        return tuple(map(sum, itertools.zip_longest(*present, fillvalue=0)))
    return sum(present)
