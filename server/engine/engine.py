"""The serving engine: one thread owns the model and the KV cache and runs continuous batching.

Each step is schedule -> execute -> update (`Scheduler.schedule`, `ModelRunner.execute`,
`Engine._update`). Requests join and leave between steps. Callers submit from any thread and get
their events through a sink (server/engine/sinks.py); an asyncio loop gets one wake-up per step
carrying all of that step's events. No HTTP code here.
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

from model import kernels
from model.checkpoint import DEFAULT_CHECKPOINT, load_model, load_tokenizer
from model.device import resolve_device, resolve_dtype
from model.gpt import GPT
from model.kv_cache import PagedKVCache, kv_cache_blocks, resolve_kv_cache_dtype
from model.sampling import SamplingParams, resolve_seed
from model.tokenizer import Tokenizer
from server.engine.admission import check_fits
from server.engine.attention_rows import generated_token_rows
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig, EngineInfo
from server.engine.counters import EngineCounters
from server.engine.kernel_spin import KernelSpin
from server.engine.kv_view import KVSnapshot, kv_snapshot
from server.engine.model_runner import ModelRunner, StepResult
from server.engine.one_by_one import execute_one_by_one
from server.engine.output_processor import OutputProcessor
from server.engine.request import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, Request, Sink, TokenOutput
from server.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from server.engine.sinks import LoopHandover
from server.engine.speculative import Drafter
from server.engine.step_budget import StepBudget
from server.engine.step_stats import StepStats, StepStatsSnapshot
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


class Engine:
    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        name: str = "model",
        **overrides: Any,
    ) -> None:
        """`config` (or its fields as keywords) sets the limits; see EngineConfig. The model is prepared
        for the kernels the config asks for, in place (for every holder of the model)."""
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config, self.name = config, name
        if config.kernels != "auto" and config.kernels != model.kernels:
            model.prepare_for_inference(config.kernels)
        self.threads = config.threads or torch.get_num_threads()
        kernels.set_num_threads(self.threads)
        if model.kernels == "exact" and config.block_size % 8:
            raise ValueError(f"the exact kernels need a block size that is a multiple of 8, got {config.block_size}")
        self.model, self.tokenizer, self.model_config = model, tokenizer, model.config
        self.device = model.device
        bs = config.block_size
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        num_blocks = kv_cache_blocks(
            model.config, bs, cache_dtype, num_blocks=config.num_blocks, memory_bytes=config.kv_cache_memory
        )
        self.cache = PagedKVCache(model.config, num_blocks, bs, dtype=cache_dtype, device=self.device)
        self.blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        target_s = None if config.target_step_ms is None else config.target_step_ms / 1000
        self.budget = StepBudget(config.max_num_batched_tokens, target_s=target_s)
        self.step_stats = StepStats()
        self.kernel_spin = KernelSpin()
        self.scheduler = Scheduler(
            self.blocks, self.budget, max_num_seqs=config.max_num_seqs, max_waiting=config.max_waiting
        )
        self.drafter = (
            Drafter(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max, config.ngram_history
            )
            if config.speculative == "ngram"
            else None
        )
        self.runner = ModelRunner(
            model,
            self.cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.num_speculative_tokens if self.drafter else 0,
        )
        if self.drafter is not None and model.kernels != "exact":
            log.warning(
                "speculative decoding with torch's kernels: verify rows may differ from one-row decodes "
                "in the last bits, so the output may differ from decoding without it"
            )
        self.outputs = OutputProcessor(tokenizer)
        self.handover = LoopHandover(config.stream_interval_ms / 1000)  # events to event loops (sinks.py)
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
        return self.model_config.n_positions

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
        return EngineCounters(
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.preemptions,
            spec_decode=None if self.drafter is None else self.drafter.stats.snapshot(),
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
        seed = resolve_seed(params.seed)
        req = Request(
            prompt_ids,
            params,
            seed,
            sink,
            use_cache=use_cache,
            cache_salt=cache_salt,
            request_id=request_id,
            speculative=speculative,
        )
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
        two steps: (n_layer, n_head, Q, P + Q), rounded, on the CPU."""
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
        self._deliver(
            [(req, self.outputs.end(req, FINISH_ERROR, SHUTDOWN_MESSAGE, "shutdown")) for req in self.scheduler.drain()]
        )

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
                    events = [
                        (req, self.outputs.end(req, FINISH_ERROR, "internal engine error", "generation"))
                        for req in self.scheduler.drain()
                    ]
                    self._deliver(events)

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

    # ---- one step: schedule -> execute -> update --------------------------------------------------

    def step(self) -> SchedulerOutput:
        if self.drafter is not None:
            self.drafter.draft_all(self.scheduler.running)  # the schedule fits what it can
        sched = self.scheduler.schedule()
        if self.handover.holding and sched.work.prompt_tokens > sum(map(len, sched.drafts.values())):
            self.handover.flush()  # a longer step (prompt work, not drafts): what is held goes first
        events = [(req, self.outputs.end(req, FINISH_ABORT)) for req in sched.aborted]
        try:  # what this step produced reaches its sinks even if a later part fails (`_run` ends the rest)
            if sched.num_tokens:
                try:
                    began = time.perf_counter()
                    result = self.runner.run(sched)
                    seconds = time.perf_counter() - began
                except Exception:
                    log.exception("batched step failed; rerunning its requests one by one")
                    result = execute_one_by_one(self.runner, sched, lambda req, error: self._fail(req, error, events))
                else:
                    self.budget.observe(sched.work, seconds)
                    self.step_stats.observe(sched.work, seconds)
                    self.kernel_spin.observe(seconds, len(sched.num_tokens))
                self._update(sched, result, events)
        finally:
            self._deliver(events)
        return sched

    def _update(self, sched: SchedulerOutput, result: StepResult, events: list) -> None:
        for req, (drafted, accepted) in result.verified.items():
            self.drafter.record(req, drafted, accepted)
        for req, entries in result.prompt_logprobs.items():
            have = len(req.prompt_logprobs)  # a resumed request computes its prompt again: keep the first
            req.prompt_logprobs += [e for e in entries if e.position > have]
        for req, n in sched.num_tokens.items():
            if req.finished:
                continue
            req.num_computed += n - len(sched.drafts.get(req, ()))  # a draft's positions count once accepted
            self.blocks.register_full_blocks(req)
            if req.params.max_new_tokens == 0 and req.num_computed >= req.num_prompt_tokens:
                self.scheduler.finish(req)  # the prompt is scored: nothing to generate
                events.append((req, self.outputs.end(req, FINISH_LENGTH)))
        for s in result.sampled:
            req = s.request
            if req.finished:
                continue
            if s.error is not None:
                self._fail(req, s.error, events)
                continue
            try:
                out = self.outputs.append(req, s.token_id, s.logprob, s.top)
            except Exception as e:
                self._fail(req, f"{type(e).__name__}: {e}", events)
                continue
            if s.cached:  # an accepted draft token: the step computed its keys and values
                req.num_computed += 1
                req.stats.accepted_draft_tokens += 1
                self.blocks.register_full_blocks(req)
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                if self.drafter is not None:
                    self.drafter.finished(req)
            events.append((req, out))

    def _fail(self, req: Request, error: str, events: list) -> None:
        """Ends one request with an error. Its blocks leave the prefix cache and are zeroed: a NaN left
        there would reach every later holder (a masked value still counts as 0 * NaN in some kernels)."""
        log.warning("request %s failed: %s", req.request_id, error)
        held = list(req.block_ids)
        self.scheduler.finish(req)
        unheld = [b for b in held if self.blocks.ref_counts[b] == 0]
        self.blocks.forget(unheld)
        self.cache.zero_blocks(unheld)
        events.append((req, self.outputs.end(req, FINISH_ERROR, f"generation failed: {error}", "generation")))

    def _deliver(self, events: list[tuple[Request, TokenOutput]]) -> None:
        """Hands a step's events to their sinks: one wake-up per event loop for all of its requests."""
        with self.handover.step():
            for req, out in events:
                try:
                    req.sink(out)
                except Exception:  # the consumer is gone: stop generating for it
                    self._consumer_gone(req)

    def _consumer_gone(self, req: Request) -> None:
        if not req.finished:
            req.finish_reason = FINISH_ABORT
            self.scheduler.finish(req)
