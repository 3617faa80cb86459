"""Prometheus metrics named after vLLM's (`vllm:` -> `kvserve:`), in a registry of the app's own so
several apps in one process never clash. Label children are bound once, here, not per token."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from server.engine import FINISH_EOS, FINISH_STOP, EngineInfo, RequestStats, TokenOutput
from server.engine.counters import EngineCounters
from server.engine.step_stats import HistogramSnapshot, StepStatsSnapshot

PREFIX = "kvserve:"
# vLLM's buckets, with sub-millisecond ones added: a small model on a GPU is that fast.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
FINISHED_REASONS = ("stop", "length", "abort", "error")


def finished_reason_label(reason: str) -> str:
    """vLLM's labels: stop (EOS or a stop string), length, abort; plus error."""
    return "stop" if reason in (FINISH_EOS, FINISH_STOP) else reason


STRUCTURED_OUTPUT_DOCS = {  # server/engine/counters.py's StructuredOutputCounters, field by field
    "requests": "Requests taken with a grammar (JSON schema, regex, choice, EBNF, or a forced tool call).",
    "mask_rows": "Rows whose pick a grammar restricted (speculative drafts' rows included).",
    "mask_seconds": "Time the engine spent filling grammar masks before each step's forward.",
    "grammar_compiles": "Grammars compiled (cache misses), the checks at the door included.",
    "grammar_compile_seconds": "Time spent compiling grammars.",
    "grammar_cache_hits": "Grammars found already compiled.",
}


class EngineCounterCollector:
    """Counters the engine keeps itself (prefix cache, preemptions, structured output, speculative decoding),
    read at scrape time (server/engine/counters.py)."""

    def __init__(self, model_name: str, read: Callable[[], EngineCounters]) -> None:
        self.model_name, self.read = model_name, read

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        c = self.read()
        yield self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", c.prefix_cache_queries
        )
        yield self._counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", c.prefix_cache_hits)
        yield self._counter(
            "num_preemptions", "Requests preempted (blocks freed, recomputed later).", c.num_preemptions
        )
        structured = c.structured_output
        for name, doc in STRUCTURED_OUTPUT_DOCS.items():
            yield self._counter(f"structured_output_{name}", doc, getattr(structured, name))
        spec = c.spec_decode
        if spec is None:
            return
        yield self._counter("spec_decode_num_drafts", "Speculative drafts verified.", spec.num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.", spec.num_draft_tokens)
        yield self._counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", spec.num_accepted_tokens
        )
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative drafts whose token at this position was accepted.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(position)], count)
        yield family


class StepCollector:
    """The engine's step histograms (its own buckets) and the step budget in force, read at scrape time."""

    def __init__(self, model_name: str, read: Callable[[], StepStatsSnapshot]) -> None:
        self.model_name, self.read = model_name, read

    def _histogram(self, name: str, doc: str, h: HistogramSnapshot, labels: dict[str, str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
        family.add_metric([self.model_name, *labels.values()], h.cumulative(), h.total)
        return family

    def collect(self):
        snap = self.read()
        yield self._histogram(
            "step_duration_seconds", "Wall time of one engine step (forward and sampling).", snap.step_seconds, {}
        )
        tokens = HistogramMetricFamily(
            PREFIX + "step_tokens",
            "Tokens one engine step computed, by kind: decode "
            "(one a running request) or prompt (prompt chunks, recomputes).",
            labels=["model_name", "kind"],
        )
        for kind, h in (("decode", snap.decode_tokens), ("prompt", snap.prompt_tokens)):
            tokens.add_metric([self.model_name, kind], h.cumulative(), h.total)
        yield tokens
        target = GaugeMetricFamily(
            PREFIX + "step_budget_target_seconds",
            "The step time target in force (--target-step-ms); 0 when there is none.",
            labels=["model_name"],
        )
        target.add_metric([self.model_name], snap.target_step_s or 0.0)
        yield target
        cap = GaugeMetricFamily(
            PREFIX + "step_budget_max_batched_tokens",
            "Tokens one step may compute, at most (--max-num-batched-tokens).",
            labels=["model_name"],
        )
        cap.add_metric([self.model_name], snap.max_batched_tokens)
        yield cap
        allowance = GaugeMetricFamily(
            PREFIX + "step_budget_prompt_tokens", "Prompt tokens the latest step was allowed.", labels=["model_name"]
        )
        allowance.add_metric([self.model_name], snap.prompt_allowance)
        yield allowance


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m, mc = self.registry, ["model_name"], ["model_name", "use_cache"]

        def by_cache(metric: Histogram) -> dict[bool, Histogram]:
            return {flag: metric.labels(model_name, str(flag).lower()) for flag in (True, False)}

        self.running = Gauge(PREFIX + "num_requests_running", "Requests holding KV-cache blocks.", m, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued.", m, registry=r)
        self.kv_usage = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1).", m, registry=r
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", m, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", m, registry=r).labels(
            model_name
        )
        success = Counter(
            PREFIX + "request_success", "Finished requests by reason.", m + ["finished_reason"], registry=r
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused or cut short by a limit, by reason.",
            m + ["reason"],
            registry=r,
        )
        self.ttft = by_cache(
            Histogram(
                PREFIX + "time_to_first_token_seconds",
                "Arrival to first token.",
                mc,
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.itl = by_cache(
            Histogram(
                PREFIX + "inter_token_latency_seconds",
                "Time between two tokens of a request.",
                mc,
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.e2e = by_cache(
            Histogram(
                PREFIX + "e2e_request_latency_seconds",
                "Arrival to last token.",
                mc,
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.queue_time = by_cache(
            Histogram(
                PREFIX + "request_queue_time_seconds",
                "Arrival to first scheduled.",
                mc,
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt length of requests.", m, buckets=TOKEN_BUCKETS, registry=r
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Generated tokens of requests.", m, buckets=TOKEN_BUCKETS, registry=r
        ).labels(model_name)

    def bind(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        counters: Callable[[], EngineCounters],
    ) -> None:
        """The gauges and the engine's own counters read the engine's state when scraped."""
        self.running.labels(self.model_name).set_function(running)
        self.waiting.labels(self.model_name).set_function(waiting)
        self.kv_usage.labels(self.model_name).set_function(kv_usage)
        self.registry.register(EngineCounterCollector(self.model_name, counters))

    def describe(self, info: EngineInfo) -> None:
        """kvserve:kernel_info, always 1: what the model runs on, as labels (the kernels, the instruction-set
        path its products take, the weights' dtype and quantization, the device)."""
        labels = {
            "kernels": info.kernels,
            "kernel_isa": info.kernel_isa or "none",
            "dtype": info.model_dtype,
            "quantization": info.config.quantization or "none",
            "device": info.device_type,
        }
        gauge = Gauge(
            PREFIX + "kernel_info",
            "What the model runs on (always 1).",
            ["model_name", *labels],
            registry=self.registry,
        )
        gauge.labels(self.model_name, *labels.values()).set(1)

    def bind_steps(self, read: Callable[[], StepStatsSnapshot]) -> None:
        """The engine's step histograms and budget, read when scraped."""
        self.registry.register(StepCollector(self.model_name, read))

    def on_rejected(self, reason: str) -> None:
        """reason: queue_full, shutting_down, unauthorized, body_too_large, validation, prompt_too_long,
        max_new_tokens, stop_sequences, timeout (rare: labelled on the fly)."""
        self.rejected.labels(self.model_name, reason).inc()

    def on_token(self, out: TokenOutput, previous: TokenOutput | None, use_cache: bool) -> None:
        self.generation_tokens.inc()
        if previous is not None and previous.token_id is not None:
            self.itl[use_cache].observe(out.time - previous.time)

    def on_finish(self, reason: str, prompt_tokens: int, stats: RequestStats | None, use_cache: bool) -> None:
        self.success[finished_reason_label(reason)].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        if stats is None:
            return
        self.request_generation_tokens.observe(stats.generated_tokens)
        for histogram, value in (
            (self.ttft, stats.time_to_first_token_s),
            (self.e2e, stats.e2e_latency_s),
            (self.queue_time, stats.queue_time_s),
        ):
            if value is not None:
                histogram[use_cache].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
