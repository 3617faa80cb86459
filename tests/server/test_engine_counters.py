"""The engine's counters: one typed object from the engine to /metrics, summed over a cluster's replicas."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from server.api.metrics import Metrics
from server.engine.counters import EngineCounters, SpecDecodeCounters, StructuredOutputCounters

SPEC = SpecDecodeCounters(
    num_drafts=11, num_draft_tokens=12, num_accepted_tokens=13, num_accepted_tokens_per_pos=(9, 4)
)
STRUCTURED = StructuredOutputCounters(
    requests=31,
    mask_rows=32,
    mask_seconds=0.25,
    grammar_compiles=33,
    grammar_compile_seconds=0.5,
    grammar_cache_hits=34,
)
COUNTERS = EngineCounters(
    prefix_cache_queries=21, prefix_cache_hits=22, num_preemptions=23, spec_decode=SPEC, structured_output=STRUCTURED
)


def scraped(counters: EngineCounters) -> dict[tuple[str, tuple], float]:
    metrics = Metrics("m")
    metrics.bind(lambda: 0, lambda: 0, lambda: 0.0, lambda: counters)
    families = text_string_to_metric_families(metrics.render().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_every_counter_field_is_exported_under_its_name_with_its_value():
    samples = scraped(COUNTERS)
    model = (("model_name", "m"),)
    for f in dataclasses.fields(EngineCounters):
        if f.name not in ("spec_decode", "structured_output"):
            assert samples.get((f"kvserve:{f.name}_total", model)) == getattr(COUNTERS, f.name), f.name
    for f in dataclasses.fields(StructuredOutputCounters):
        name = f"kvserve:structured_output_{f.name}_total"
        assert samples.get((name, model)) == getattr(STRUCTURED, f.name), f.name
    for f in dataclasses.fields(SpecDecodeCounters):
        name = f"kvserve:spec_decode_{f.name}_total"
        value = getattr(SPEC, f.name)
        if isinstance(value, tuple):
            assert [samples.get((name, (("model_name", "m"), ("position", str(i))))) for i in range(2)] == list(value)
        else:
            assert samples.get((name, model)) == value, f.name


def test_an_engine_that_does_not_speculate_exports_no_spec_decode_counter():
    samples = scraped(dataclasses.replace(COUNTERS, spec_decode=None))
    assert ("kvserve:num_preemptions_total", (("model_name", "m"),)) in samples
    assert not [name for name, _ in samples if "spec_decode" in name]


def test_counters_sum_over_engines_field_by_field():
    plain = EngineCounters(prefix_cache_queries=1, prefix_cache_hits=2, num_preemptions=3)
    other = SpecDecodeCounters(
        num_drafts=1, num_draft_tokens=2, num_accepted_tokens=3, num_accepted_tokens_per_pos=(1,)
    )
    assert EngineCounters.summed([COUNTERS, plain, dataclasses.replace(COUNTERS, spec_decode=other)]) == EngineCounters(
        prefix_cache_queries=43,
        prefix_cache_hits=46,
        num_preemptions=49,
        spec_decode=SpecDecodeCounters(
            num_drafts=12, num_draft_tokens=14, num_accepted_tokens=16, num_accepted_tokens_per_pos=(10, 4)
        ),
        structured_output=StructuredOutputCounters(
            requests=62,
            mask_rows=64,
            mask_seconds=0.5,
            grammar_compiles=66,
            grammar_compile_seconds=1.0,
            grammar_cache_hits=68,
        ),
    )
    assert EngineCounters.summed([plain, plain]) == EngineCounters(2, 4, 6, None)
    assert EngineCounters.summed([]) == EngineCounters()


def test_counters_come_back_from_their_dict_form():
    assert EngineCounters.from_dict(dataclasses.asdict(COUNTERS)) == COUNTERS
    assert EngineCounters.from_dict(dataclasses.asdict(EngineCounters())) == EngineCounters()
