"""One engine step over the pieces it owns: schedule -> execute -> update (vLLM's `EngineCore`).

`EngineCore` builds, for one model, the KV cache, the block pool, the scheduler, the drafter, the model
runner and the output processor; `step` runs one schedule (`Scheduler.schedule`), its forward
(`ModelRunner.run`) and the update of every request it touched (`_update`), then hands the step's events
to their sinks. It runs no thread and takes no request: `Engine` (engine.py) does both around it.
"""

from __future__ import annotations

import logging
import time

import torch

from model import kernels
from model.description import InferenceModel, ModelDescription
from model.grammar import GrammarCompiler
from model.kv_cache import PagedKVCache, kv_cache_blocks, resolve_kv_cache_dtype
from model.tokenizer import Tokenizer
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.context_length import served_config
from server.engine.kernel_spin import KernelSpin
from server.engine.model_runner import ModelRunner, StepResult
from server.engine.one_by_one import execute_one_by_one
from server.engine.output_processor import OutputProcessor
from server.engine.request import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, Request, TokenOutput
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sinks import LoopHandover
from server.engine.speculative import Drafter
from server.engine.step_budget import StepBudget
from server.engine.step_stats import StepStats

log = logging.getLogger("kvserve.engine")


class EngineCore:
    def __init__(self, model: InferenceModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        """Builds the pieces for `model` under `config`. The model is prepared for the kernels the config
        asks for, in place (for every holder of the model)."""
        self.config = config
        if config.kernels != "auto" and config.kernels != model.kernels:
            model.prepare_for_inference(config.kernels)
        self.threads = config.threads or torch.get_num_threads()
        kernels.set_num_threads(self.threads)
        if model.kernels == "exact" and config.block_size % 8:
            raise ValueError(f"the exact kernels need a block size that is a multiple of 8, got {config.block_size}")
        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        bs = config.block_size
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        if cache_dtype == torch.int8 and model.kernels != "exact":
            raise ValueError("an int8 KV cache (--kv-cache-dtype int8) needs the exact kernels, which run on the CPU")
        if cache_dtype == torch.int8 and config.block_size > kernels.INT8_CACHE_MAX_BLOCK:
            raise ValueError(
                f"an int8 KV cache takes blocks of at most {kernels.INT8_CACHE_MAX_BLOCK} tokens, got --block-size "
                f"{config.block_size}"
            )
        # the model as served: its context capped by --max-model-len or the default KV cache (context_length.py)
        self.model_config: ModelDescription = served_config(
            model.config,
            max_model_len=config.max_model_len,
            kv_cache_sized=bool(config.num_blocks) or config.kv_cache_memory is not None,
            block_size=bs,
            cache_dtype=cache_dtype,
            device=self.device,
        )
        num_blocks = kv_cache_blocks(
            self.model_config, bs, cache_dtype, num_blocks=config.num_blocks, memory_bytes=config.kv_cache_memory
        )
        self.cache = PagedKVCache(self.model_config, num_blocks, bs, dtype=cache_dtype, device=self.device)
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
            self.model_config,
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
        self.grammars = GrammarCompiler.shared(tokenizer, self.model_config.vocab_size)  # structured output's
        self.structured_requests = 0  # requests taken with a grammar, since start
        self.handover = LoopHandover(config.stream_interval_ms / 1000)  # events to event loops (sinks.py)

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
            complete = False
            if req.grammar is not None:  # the matcher follows the kept token (the pick allowed only those)
                if not req.grammar.accept(s.token_id):
                    self._fail(req, f"its grammar refused token {s.token_id}: {req.grammar.error}", events)
                    continue
                complete = req.grammar.complete
            try:
                out = self.outputs.append(req, s.token_id, s.logprob, s.top, complete)
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

    def end_all(self, message: str, error_type: str) -> None:
        """Ends every request in flight with an error event (`error_type`: shutdown, generation...)."""
        self._deliver(
            [(req, self.outputs.end(req, FINISH_ERROR, message, error_type)) for req in self.scheduler.drain()]
        )

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
