"""The serving engine: one thread owns the model and the KV cache and runs continuous batching.

`Engine` is the service around `EngineCore` (core.py), which owns the pieces and runs one step,
schedule -> execute -> update. The engine takes requests in (`submit`, refused at once when they can
never fit: admission.py), runs steps on its own thread while there is work, runs short calls between
two steps (`run_between_steps`: the KV view, attention rows), and starts, drains and shuts down.
Requests join and leave between steps. Callers submit from any thread and get their events through a
sink (server/engine/sinks.py); an asyncio loop gets one wake-up per step carrying all of that step's
events. No HTTP code here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import DEFAULT_CHECKPOINT, load_model, load_tokenizer
from model.description import InferenceModel
from model.device import resolve_device, resolve_dtype
from model.sampling import SamplingParams, resolve_seed
from model.tokenizer import Tokenizer
from server.engine.admission import check_fits
from server.engine.attention_rows import generated_token_rows
from server.engine.config import EngineConfig, EngineInfo
from server.engine.core import EngineCore
from server.engine.counters import EngineCounters, StructuredOutputCounters
from server.engine.kv_view import KVSnapshot, kv_snapshot
from server.engine.request import Request, Sink, TokenOutput
from server.engine.scheduler import SchedulerStats
from server.engine.step_stats import StepStatsSnapshot
from server.engine.thread_priority import set_up_compute_threads
from server.engine.warmup import calibrate, warm_up

log = logging.getLogger("kvserve.engine")

SHUTDOWN_MESSAGE = "the server shut down before this request finished"


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or shut down and takes no more requests."""


@dataclass
class EngineArgs:
    checkpoint: Path = DEFAULT_CHECKPOINT
    device: str = "auto"  # auto = CUDA when present, else CPU
    dtype: str = "float32"
    config: EngineConfig = field(default_factory=EngineConfig)


class Engine(EngineCore):
    def __init__(
        self,
        model: InferenceModel,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        name: str = "model",
        **overrides: Any,
    ) -> None:
        """`config` (or its fields as keywords) sets the limits; see EngineConfig. The model is prepared
        for the kernels the config asks for, in place (for every holder of the model)."""
        super().__init__(model, tokenizer, dataclasses.replace(config or EngineConfig(), **overrides))
        self.name = name
        self._wakeup = threading.Condition()
        self._step_lock = threading.Lock()  # held for the length of a step; `paused()` holds it too
        self._stopping = False
        self._admitting = True  # False once a graceful shutdown has begun
        self._thread: threading.Thread | None = None
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # `run_between_steps` work, FIFO

    @classmethod
    def from_args(cls, args: EngineArgs) -> Engine:
        """Loads the checkpoint onto the device; the engine is not started."""
        device = resolve_device(args.device)
        model = load_model(
            args.checkpoint,
            device=device,
            dtype=resolve_dtype(args.dtype),
            kernels=args.config.kernels,
            quantization=args.config.quantization,
        )
        return cls(model, load_tokenizer(args.checkpoint), args.config, name=Path(args.checkpoint).name)

    # ---- what callers see -------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        """Tokens a sequence may hold: the model's context, or less (server/engine/context_length.py)."""
        return self.model_config.context_length

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks held by requests (0..1)."""
        return self.blocks.usage

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def counters(self) -> EngineCounters:
        """The engine's running totals for /metrics (the spec-decode ones when it speculates)."""
        s = self.scheduler.stats
        masks, compiles = self.runner.sampler.mask_stats, self.grammars.stats
        return EngineCounters(
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.preemptions,
            spec_decode=None if self.drafter is None else self.drafter.stats.snapshot(),
            structured_output=StructuredOutputCounters(
                requests=self.structured_requests,
                mask_rows=masks.rows,
                mask_seconds=masks.seconds,
                grammar_compiles=compiles.compiles,
                grammar_compile_seconds=compiles.seconds,
                grammar_cache_hits=compiles.hits,
            ),
        )

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            str(self.model.dtype).removeprefix("torch."),
            self.device.type,
            self.model.kernels,
            self.blocks.num_blocks,
            self.blocks.block_size,
            self.config,
            kernel_isa=self.model.kernel_isa,
        )

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (a replica's health check)."""
        return self._thread is not None and self._thread.is_alive()

    def step_stats_snapshot(self) -> StepStatsSnapshot:
        """Step time and tokens per step so far, with the step budget in force (for /metrics)."""
        budget = self.budget
        return self.step_stats.snapshot(budget.target_s, budget.max_num_batched_tokens, budget.last_allowance)

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
        """Queues a request; `sink` gets its TokenOutputs on the engine thread and must not block.
        Raises PromptError (prompt too long, empty...), QueueFullError, EngineStoppedError at once."""
        check_fits(prompt_ids, params.max_new_tokens, self.blocks, self.context_length, self.model_config.vocab_size)
        return self._enqueue([self._request(prompt_ids, params, sink, use_cache, request_id, cache_salt, speculative)])[
            0
        ]

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
        """Several requests for one prompt (OpenAI's n and best_of): the first reads the prompt, the others
        wait until its keys and values are in the prefix cache and take them from there. All or none
        are queued."""
        check_fits(
            prompt_ids,
            max(p.max_new_tokens for p in params),
            self.blocks,
            self.context_length,
            self.model_config.vocab_size,
            copies=len(params),
        )  # the longest copy decides
        reqs = [
            self._request(prompt_ids, p, sink, use_cache, None, cache_salt, speculative)
            for p, sink in zip(params, sinks)
        ]
        if use_cache and self.config.enable_prefix_caching and params[0].prompt_logprobs is None:
            for req in reqs[1:]:
                req.wait_for = reqs[0]
        return self._enqueue(reqs)

    def _request(self, prompt_ids, params, sink, use_cache, request_id, cache_salt, speculative) -> Request:
        """A Request for `params`; with a grammar, its matcher (GrammarError if the grammar does not compile)."""
        seed = resolve_seed(params.seed)
        grammar = None if params.grammar is None else self.grammars.matcher(params.grammar)
        req = Request(
            prompt_ids,
            params,
            seed,
            sink,
            use_cache=use_cache,
            cache_salt=cache_salt,
            request_id=request_id,
            speculative=speculative,
            grammar=grammar,
        )
        self.structured_requests += grammar is not None
        self.outputs.start(req)
        return req

    def _enqueue(self, reqs: list[Request]) -> list[str]:
        with self._wakeup:  # the same lock shutdown takes to set _stopping: a request is refused or drained
            if self._stopping or not self._admitting:
                raise EngineStoppedError("the server is shutting down and takes no new requests")
            self.scheduler.add_all(reqs)
            self._wakeup.notify()
        return [r.request_id for r in reqs]

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        use_cache: bool = True,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> list[TokenOutput]:
        """Blocking helper: submits and waits for every event (not for use on an event loop)."""
        events: queue.Queue = queue.Queue()
        self.submit(prompt_ids, params, events.put, use_cache=use_cache, cache_salt=cache_salt)
        outs = [events.get(timeout=timeout)]
        while not outs[-1].finished:
            outs.append(events.get(timeout=timeout))
        return outs

    def run_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Runs `fn` on the engine thread between two steps, so it may use the model (e.g. attention
        weights for inspection) without racing a step; its result or exception lands in the Future.
        Needs a started engine. The steps of running requests wait for `fn`, so keep it short."""
        future: Future = Future()
        with self._wakeup:
            if self._stopping:
                raise EngineStoppedError("the engine is shut down")
            self._calls.append((fn, future))
            self._wakeup.notify()
        return future

    async def kv_snapshot(self) -> KVSnapshot:
        """The block pool now (server/engine/kv_view.py), taken between two steps."""
        return await asyncio.wrap_future(self.run_between_steps(lambda: kv_snapshot(self.blocks, self.scheduler)))

    async def attention_rows(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """What the first generated tokens attended to (server/engine/attention_rows.py), computed between
        two steps: (num_layers, num_heads, Q, P + Q), rounded, on the CPU."""
        future = self.run_between_steps(lambda: generated_token_rows(self.model, prompt_ids, output_ids))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Cancels a request (waiting or running); it ends with finish_reason 'abort'."""
        self.scheduler.abort(request_id)
        with self._wakeup:
            self._wakeup.notify()

    # ---- life cycle -------------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()
        return self

    def warmup(self) -> None:
        """Runs a short request both ways, so the first real request pays no first-call costs, then
        calibrates the step budget's costs when there is a time target (server/engine/warmup.py)."""
        warm_up(self.submit, self.tokenizer, self.context_length)
        if self.budget.target_s is not None:
            calibrate(self.submit, self.tokenizer, self.context_length, self.budget, self.blocks, self.config)

    def stop_admitting(self) -> None:
        """New requests are refused (EngineStoppedError) from now on; those already in go on."""
        with self._wakeup:  # as in submit: a request is either in before this or refused after it
            self._admitting = False

    def drain(self, grace: float) -> None:
        """Graceful shutdown: refuses new requests, lets those in flight run for up to `grace` seconds,
        then ends the rest with an error event of type 'shutdown'. Blocks until then."""
        self.stop_admitting()
        deadline = time.monotonic() + grace
        while self.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.scheduler.has_work():
            try:  # on the engine thread, before its next step, so no step touches what is ended here
                self.run_between_steps(self._end_all_for_shutdown).result()
            except EngineStoppedError:
                pass  # `shutdown` ends them

    def _end_all_for_shutdown(self) -> None:
        self.end_all(SHUTDOWN_MESSAGE, "shutdown")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; requests still in flight end with a 'shutdown' error. Their state is
        freed on the engine thread, after the step it may be in the middle of, never under it."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is None:
            self._end_all_for_shutdown()  # never started: no step can be running
        else:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("a step is still running after %g s; its requests end when it returns", timeout)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No step runs inside this block; requests still queue up, so those submitted inside it are admitted
        together and share their steps (bench/vs_transformers.py times a batch so)."""
        with self._step_lock:
            yield

    def _run(self) -> None:
        set_up_compute_threads(
            self.model.kernels == "exact", self.config.threads, self.config.engine_niceness, self.threads
        )
        while True:
            with self._wakeup:
                while not self._stopping and not self.scheduler.has_work() and not self._calls:
                    self.handover.flush()  # nothing held waits for a step that may not come
                    self._wakeup.wait()
                stopping = self._stopping
            with self._step_lock:
                if stopping:
                    while self._calls:
                        future = self._calls.popleft()[1]
                        if future.set_running_or_notify_cancel():  # its caller may have cancelled it
                            future.set_exception(EngineStoppedError("the engine is shut down"))
                    self._end_all_for_shutdown()  # every request's last event: what is held goes with it
                    return
                self._run_calls()
                try:
                    self.step()
                except Exception:  # a bug outside any one request: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self.end_all("internal engine error", "generation")

    def _run_calls(self) -> None:
        if self._calls:  # a call may take a while (a forward for the attention view): what is held goes first
            self.handover.flush()
        while self._calls:
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller's failure, handed back to the caller
                    future.set_exception(e)
