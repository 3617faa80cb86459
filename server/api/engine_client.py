"""What the HTTP layer needs of an engine, and nothing more. Two implementations: the local `Engine`
(`python -m server`) and the cluster's `RayEngineClient` (`python -m server.cluster`), which carries the
same calls to engine replicas on Ray Serve."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from model.description import ModelDescription
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from server.engine import EngineConfig, EngineInfo, TokenOutput
from server.engine.counters import EngineCounters
from server.engine.kv_view import KVSnapshot
from server.engine.step_stats import StepStatsSnapshot

Sink = Callable[[TokenOutput], None]


class NotInProcessError(RuntimeError):
    """Asked of an engine whose model and block pool live in other processes (the cluster's replicas) what
    only their own process can answer: the KV-cache view, attention weights."""


class EngineClient(Protocol):
    tokenizer: Tokenizer
    model_config: ModelDescription  # the model as served: its context may be shorter than its config.json's
    config: EngineConfig

    @property
    def context_length(self) -> int: ...

    @property
    def info(self) -> EngineInfo: ...

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        use_cache: bool = True,
        request_id: str | None = None,
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> str:
        """Queues a request; its events go to `sink`, the last with finish_reason set. Raises PromptError,
        QueueFullError or EngineStoppedError at once."""

    def submit_copies(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        sinks: list[Sink],
        *,
        use_cache: bool = True,
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> list[str]:
        """Several requests for one prompt (n, best_of), all or none."""

    async def admitted(self, request_ids: list[str]) -> None:
        """Engines in other processes (`info.in_process` False): returns once they have taken these
        requests, or raises QueueFullError or EngineStoppedError if they refused them. (The local engine
        takes or refuses a request in `submit`, and is not asked.)"""

    def abort(self, request_id: str) -> None:
        """Cancels a request; it ends with an 'abort' event."""

    # the gauges and counters of /metrics
    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...

    def counters(self) -> EngineCounters:
        """Running totals (prefix cache, preemptions, speculative decoding)."""

    def step_stats_snapshot(self) -> StepStatsSnapshot:
        """Step time and tokens per step so far, with the step budget in force."""

    # inspection, between two steps of the engine; NotInProcessError where `info.in_process` is False
    async def kv_snapshot(self) -> KVSnapshot:
        """The block pool now (server/engine/kv_view.py). Raises EngineStoppedError once the engine stopped."""

    async def attention_rows(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """What the first generated tokens attended to, from one uncached recompute: (num_layers, num_heads, Q,
        P + Q), rounded, on the CPU (server/engine/attention_rows.py). Raises EngineStoppedError once the
        engine stopped."""

    # the app's life cycle
    def start(self) -> EngineClient: ...

    def warmup(self) -> None: ...

    def drain(self, grace: float) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...
