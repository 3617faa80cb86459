"""Prometheus metrics named after vLLM's (`vllm:` -> `kvserve:`), in a registry of the app's own so
several apps in one process never clash."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from server.sequence import FINISH_EOS, FINISH_STOP, RequestStats, TokenOutput

PREFIX = "kvserve:"
# vLLM's buckets, with sub-millisecond ones added: a small model on a GPU is that fast.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def finished_reason_label(reason: str) -> str:
    """vLLM's labels: stop (EOS or a stop string), length, abort; plus error."""
    return "stop" if reason in (FINISH_EOS, FINISH_STOP) else reason


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        mc = ["model_name", "use_cache"]
        self.running = Gauge(PREFIX + "num_requests_running", "Requests holding a slot.", m, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a slot.", m, registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache slots in use (0-1).", m,
                              registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", m, registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                               m + ["finished_reason"], registry=r)
        self.rejected = Counter(PREFIX + "request_rejected", "Requests refused or cut short by a limit, by reason.",
                                m + ["reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.", mc,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.", mc,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", mc,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to taking a slot.", mc,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt length of requests.", m,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Generated tokens of requests.", m, buckets=TOKEN_BUCKETS,
                                                   registry=r)

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]) -> None:
        """The gauges read the engine's state when scraped."""
        self.running.labels(self.model_name).set_function(running)
        self.waiting.labels(self.model_name).set_function(waiting)
        self.kv_usage.labels(self.model_name).set_function(kv_usage)

    def on_rejected(self, reason: str) -> None:
        """reason: queue_full, shutting_down, unauthorized, body_too_large, validation, prompt_too_long,
        max_new_tokens, stop_sequences, timeout."""
        self.rejected.labels(self.model_name, reason).inc()

    def on_token(self, out: TokenOutput, previous: TokenOutput | None, use_cache: bool) -> None:
        self.generation_tokens.labels(self.model_name).inc()
        if previous is not None and previous.token_id is not None:
            self.itl.labels(self.model_name, str(use_cache).lower()).observe(out.time - previous.time)

    def on_finish(self, reason: str, prompt_tokens: int, stats: RequestStats | None, use_cache: bool) -> None:
        name, cache = self.model_name, str(use_cache).lower()
        self.success.labels(name, finished_reason_label(reason)).inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        if stats is None:
            return
        self.request_generation_tokens.labels(name).observe(stats.generated_tokens)
        for histogram, value in ((self.ttft, stats.time_to_first_token_s), (self.e2e, stats.e2e_latency_s),
                                 (self.queue_time, stats.queue_time_s)):
            if value is not None:
                histogram.labels(name, cache).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
