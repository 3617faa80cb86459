"""The serving engine: one thread owns the model and the KV cache and runs continuous batching.

Each step is schedule -> execute -> update (`Scheduler.schedule`, `ModelRunner.execute`,
`Engine._update`). Requests join and leave between steps. Callers submit from any thread and get
their tokens through a sink; `Engine.stream` turns that into an async iterator for an asyncio loop,
with no blocking call on the loop. No HTTP code here.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import DEFAULT_CHECKPOINT, load_model, load_tokenizer
from model.device import resolve_device, resolve_dtype
from model.generate import check_prompt
from model.gpt import GPT
from model.kv_cache import KVCache
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from server.runner import ModelRunner, Sampled
from server.scheduler import (DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_PREFILL_CHUNK, QueueFullError, Scheduler,
                              SchedulerOutput)
from server.sequence import FINISH_ABORT, FINISH_ERROR, Sequence, Sink, TokenOutput

log = logging.getLogger("kvserve.engine")

__all__ = ["Engine", "EngineArgs", "EngineStoppedError", "QueueFullError", "RequestStream"]


SHUTDOWN_MESSAGE = "the server shut down before this request finished"


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or shut down and takes no more requests."""


@dataclass
class EngineArgs:
    checkpoint: Path = DEFAULT_CHECKPOINT
    device: str = "auto"  # auto = CUDA when present, else CPU
    dtype: str = "float32"
    max_batch: int = 32  # concurrent sequences = KV-cache slots
    max_waiting: int = 128  # requests queued beyond max_batch before new ones get 429
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens one request reads per step
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # prompt tokens all requests together read per step
    threads: int | None = None  # CPU threads for the engine's ops (None: torch's default); see Engine
    compile: bool = False  # decode steps through torch.compile; warmup() compiles them before serving


class RequestStream:
    """Async iterator over one request's TokenOutputs, fed from the engine thread. The last event
    has finish_reason set. `cancel()` aborts the request; its slot is freed at the next step."""

    def __init__(self, engine: "Engine", request_id: str, events: asyncio.Queue) -> None:
        self.engine, self.request_id, self._events = engine, request_id, events
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenOutput:
        if self.done:
            raise StopAsyncIteration
        out = await self._events.get()
        self.done = out.finished
        return out

    def cancel(self) -> None:
        if not self.done:
            self.engine.abort(self.request_id)


class Engine:
    def __init__(self, model: GPT, tokenizer: Tokenizer, *, max_batch: int = 32, max_waiting: int = 128,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 name: str = "model", threads: int | None = None, compile: bool = False) -> None:
        """`threads` sets torch's intra-op threads on the engine thread (None: torch's default, one
        per core), and re-prepares the model's weight blocks for that many threads, in place, for every
        holder of the model. On a 2-core CPU, 2 threads beat 1 under load even though the HTTP loop shares
        the cores (BENCHMARKS.md: more tokens/s at concurrency 32, lower p99 there, a noisier p99 alone)."""
        self.threads = threads
        if threads:  # the weight blocks follow the engine's thread count (the model is changed in place)
            model.prepare_for_inference(threads)
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.config = model.config
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(self.config, max_batch, dtype=param.dtype, device=self.device)
        self.scheduler = Scheduler(self.cache, max_batch, max_waiting, prefill_chunk, max_prefill_tokens)
        self.runner = ModelRunner(model, self.cache, compiled=compile)
        self._wakeup = threading.Condition()
        self._step_lock = threading.Lock()  # held for the length of a step; `paused()` holds it too
        self._stopping = False
        self._admitting = True  # False once a graceful shutdown has begun
        self._thread: threading.Thread | None = None
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # `run_between_steps` work, FIFO

    @classmethod
    def from_args(cls, args: EngineArgs) -> "Engine":
        """Loads the checkpoint onto the device; the engine is not started."""
        device = resolve_device(args.device)
        model = load_model(args.checkpoint, device=device, dtype=resolve_dtype(args.dtype))
        return cls(model, load_tokenizer(args.checkpoint), max_batch=args.max_batch, max_waiting=args.max_waiting,
                   prefill_chunk=args.prefill_chunk, max_prefill_tokens=args.max_prefill_tokens, threads=args.threads,
                   name=Path(args.checkpoint).name, compile=args.compile)

    # ---- what callers see -------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache slots held by running requests (0..1)."""
        return self.cache.num_used / self.cache.num_slots

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, *, use_cache: bool = True,
               request_id: str | None = None) -> str:
        """Queues a request; `sink` gets its TokenOutputs on the engine thread and must not block.
        Raises PromptError (prompt too long, empty...), QueueFullError, EngineStoppedError at once."""
        check_prompt(prompt_ids, params.max_new_tokens, self.context_length, self.config.vocab_size)
        seq = Sequence(prompt_ids, params, self.tokenizer, sink, use_cache=use_cache, device=self.device,
                       request_id=request_id)
        with self._wakeup:  # the same lock shutdown takes to set _stopping: a request is refused or drained
            if self._stopping or not self._admitting:
                raise EngineStoppedError("the server is shutting down and takes no new requests")
            self.scheduler.add(seq)
            self._wakeup.notify()
        return seq.request_id

    def stream(self, prompt_ids: list[int], params: SamplingParams, *, use_cache: bool = True,
               request_id: str | None = None) -> RequestStream:
        """Submits from a running asyncio loop; tokens cross over with call_soon_threadsafe."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(out: TokenOutput) -> None:
            loop.call_soon_threadsafe(events.put_nowait, out)

        rid = self.submit(prompt_ids, params, sink, use_cache=use_cache, request_id=request_id)
        return RequestStream(self, rid, events)

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, use_cache: bool = True,
                 timeout: float | None = None) -> list[TokenOutput]:
        """Blocking helper: submits and waits for every event (not for use on an event loop)."""
        events: queue.Queue = queue.Queue()
        self.submit(prompt_ids, params, events.put, use_cache=use_cache)
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

    def abort(self, request_id: str) -> None:
        """Cancels a request (waiting or running); it ends with finish_reason 'abort'."""
        self.scheduler.abort(request_id)
        with self._wakeup:
            self._wakeup.notify()

    # ---- life cycle -------------------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()
        return self

    def warmup(self) -> None:
        """Runs a short request both ways, so the first real request pays no first-call costs; with
        `compile`, first compiles every variant of the decode step (tens of seconds on a small CPU)."""
        if self.runner.compiled:
            try:
                self.run_between_steps(self.runner.compile_decode_variants).result(timeout=1800)
            except Exception as e:
                self.runner.fall_back_to_eager(e)
        prompt = self.tokenizer.encode("Hello") or [0]
        for use_cache in (True, False):
            self.generate(prompt[: self.context_length - 2], SamplingParams(max_new_tokens=2, temperature=0),
                          use_cache=use_cache, timeout=600)

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
        for seq in self.scheduler.drain():
            self._emit(seq, seq.end(FINISH_ERROR, SHUTDOWN_MESSAGE, "shutdown"))

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        while self._calls:
            self._calls.popleft()[1].set_exception(EngineStoppedError("the engine is shut down"))
        self._end_all_for_shutdown()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No step runs inside this block (requests still queue up). For tests and maintenance."""
        with self._step_lock:
            yield

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # per thread: the caller's setting is untouched
        while True:
            with self._wakeup:
                while not self._stopping and not self.scheduler.has_work() and not self._calls:
                    self._wakeup.wait()
                if self._stopping:
                    return
            with self._step_lock:
                self._run_calls()
                try:
                    self.step()
                except Exception:  # a bug outside any one request: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    for seq in self.scheduler.drain():
                        self._emit(seq, seq.end(FINISH_ERROR, "internal engine error", "generation"))

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller's failure, handed back to the caller
                    future.set_exception(e)

    # ---- one step: schedule -> execute -> update --------------------------------------------------

    def step(self) -> SchedulerOutput:
        batch = self.scheduler.schedule()
        for seq in batch.aborted:
            self._emit(seq, seq.end(FINISH_ABORT))
        if batch.sequences:
            try:
                sampled = self.runner.execute(batch)
            except Exception:
                log.exception("batched step failed; rerunning its requests one by one")
                sampled = self._execute_one_by_one(batch)
            self._update(batch, sampled)
        return batch

    def _execute_one_by_one(self, batch: SchedulerOutput) -> list[Sampled]:
        """Isolates the request that broke a batch: it alone fails, the others go on."""
        sampled: list[Sampled] = []
        singles = ([SchedulerOutput(prefill=[c]) for c in batch.prefill] + [SchedulerOutput(decode=[s]) for s in
                   batch.decode] + [SchedulerOutput(recompute=[s]) for s in batch.recompute])
        for single in singles:
            try:
                sampled += self.runner.execute(single)
            except Exception as e:
                self._fail(single.sequences[0], f"{type(e).__name__}: {e}")
        return sampled

    def _update(self, batch: SchedulerOutput, sampled: list[Sampled]) -> None:
        for chunk in batch.prefill:
            if not chunk.seq.finished:
                chunk.seq.num_cached = chunk.end
        for s in sampled:
            if s.error is not None:
                self._fail(s.seq, s.error)
                continue
            try:
                out = s.seq.append(s.token_id, s.logprob)
            except Exception as e:
                self._fail(s.seq, f"{type(e).__name__}: {e}")
                continue
            if s.seq.finished:
                self.scheduler.finish(s.seq)
            self._emit(s.seq, out)

    def _fail(self, seq: Sequence, error: str) -> None:
        log.warning("request %s failed: %s", seq.request_id, error)
        self.scheduler.finish(seq)
        self._emit(seq, seq.end(FINISH_ERROR, f"generation failed: {error}", "generation"))

    def _emit(self, seq: Sequence, out: TokenOutput) -> None:
        try:
            seq.sink(out)
        except Exception:  # the consumer is gone (closed loop...): stop generating for it
            if not seq.finished:
                seq.finish_reason = FINISH_ABORT
                self.scheduler.finish(seq)
