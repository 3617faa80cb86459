"""Which requests run in the next step, and how many of their tokens: vLLM V1's unified schedule,
one {request: num_tokens} for prefill and decode alike.

Each step:
1. every running request past its prompt decodes one token, and every uncached one recomputes its
   whole sequence (never split, and outside the budget: `use_cache: false` is asked to cost what it
   costs, not to hold back the cached requests' prompts);
2. the step budget (`StepBudget`) says how many prompt tokens the step may carry beside those decode
   rows: what `max_num_batched_tokens` leaves, less where a time target (`--target-step-ms`) asks;
3. prompts share them in `admission.prompt_order` (shortest remaining first, aged requests before
   all): running requests still reading their prompt take their next chunk; waiting ones are admitted
   while fewer than `max_num_seqs` run and their blocks fit, each with its prefix-cache hits and a
   first chunk;
4. decoding requests with a speculative draft (`Request.draft`) verify it, from what prompt tokens
   are left and only where free blocks hold it (a draft never preempts).
When a decoding request needs a block and none is free, the newest running request is preempted:
its blocks go back, it returns to the front of the queue, and it recomputes when it resumes.

Thread-safe on the submitting side (`add_all`, `abort` come from the HTTP event loop); everything else
runs on the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from server.engine.admission import is_aged, prompt_order
from server.engine.block_manager import BlockManager
from server.engine.request import Request, RequestStatus
from server.engine.step_budget import StepBudget, StepWork


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit: the request is refused now."""


@dataclass
class SchedulerOutput:
    """What one step runs; the model runner reads nothing else of the requests' state."""

    num_tokens: dict[Request, int] = field(default_factory=dict)  # request -> new tokens this step, in step order
    preempted: list[Request] = field(default_factory=list)  # sent back to the queue this step (blocks freed)
    aborted: list[Request] = field(default_factory=list)  # cancelled since the last step (blocks freed)
    admitted: list[Request] = field(default_factory=list)  # given a row this step (new or resumed), in order
    drafts: dict[Request, list[int]] = field(default_factory=dict)  # draft tokens verified this step (in num_tokens)
    work: StepWork = StepWork(0, 0, 0)  # what the step computes, for the step budget's cost model and the metrics


@dataclass
class SchedulerStats:
    """Running totals since start, read by /metrics."""

    prefix_cache_queries: int = 0  # prompt tokens of admitted requests that use the cache (vLLM's definition)
    prefix_cache_hits: int = 0  # of those, tokens served from the prefix cache
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        budget: StepBudget,
        *,
        max_num_seqs: int,
        max_waiting: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.blocks, self.budget, self.clock = blocks, budget, clock
        self.max_num_seqs, self.max_waiting = max_num_seqs, max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first preempted
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._aborts: set[str] = set()
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # rows of the runner's buffers no request holds

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def add_all(self, reqs: list[Request]) -> None:
        """Queues requests, all or none. The queue holds up to `max_waiting` requests beyond the running
        places still free (a new request waits for the next step even when one is free)."""
        with self._lock:
            if not self._has_room(len(reqs)):
                raise QueueFullError(
                    f"the waiting queue is full (max {self.max_waiting} requests waiting, "
                    f"{len(self.running)} running; --max-waiting); retry later"
                )
            self.waiting.extend(reqs)

    def _has_room(self, new: int) -> bool:
        """Room for `new` more requests; a request cancelled but not yet carried out (the next step does, before
        it admits any) holds no place: a replica's next request may come the moment a cancelled one ended."""
        waiting, running = len(self.waiting), len(self.running)
        if waiting + new <= self.max_waiting + max(0, self.max_num_seqs - running):
            return True
        if not self._aborts:
            return False
        waiting -= sum(r.request_id in self._aborts for r in self.waiting)
        running -= sum(r.request_id in self._aborts for r in self.running)
        return waiting + new <= self.max_waiting + max(0, self.max_num_seqs - running)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def schedule(self) -> SchedulerOutput:
        with self._lock:
            out = SchedulerOutput(aborted=self._take_aborted())
            rows = context = 0
            for req in list(self.running):  # 1. decode rows and uncached recomputes
                if req.status != RequestStatus.RUNNING:
                    continue  # preempted a moment ago, for an older request's block
                if not req.use_cache:
                    req.num_computed = 0
                n = req.num_tokens - req.num_computed
                if req.use_cache and n != 1:
                    continue  # still reading its prompt: step 3
                if self._make_room(req, req.num_tokens, out):
                    out.num_tokens[req] = n
                    if req.use_cache:
                        rows, context = rows + 1, context + req.num_tokens
            budget = self.budget.prompt_tokens(rows, context)  # 2.
            budget = self._schedule_prompts(budget, out)  # 3.
            for req in self.running:  # 4. drafts of decoding requests, from what budget is left
                if budget <= 0:
                    break
                if req.draft and out.num_tokens.get(req) == 1 and req.use_cache:
                    k = min(len(req.draft), budget)
                    if self.blocks.grow(req, req.num_tokens + k):  # never at another request's expense
                        out.num_tokens[req] += k
                        out.drafts[req] = req.draft[:k]
                        budget -= k
            prompt = sum(out.num_tokens.values()) - rows
            out.work = StepWork(rows, context, prompt)
            return out

    def _schedule_prompts(self, budget: int, out: SchedulerOutput) -> int:
        """Shares `budget` prompt tokens among running requests still reading their prompt and waiting ones;
        returns what is left."""
        reading = [r for r in self.running if r.status == RequestStatus.RUNNING and r not in out.num_tokens]
        if not reading and not self.waiting:
            return budget
        now = self.clock()
        admitting = True
        for req in prompt_order(reading + list(self.waiting), now):
            if budget <= 0:
                break
            if req.status == RequestStatus.RUNNING:
                n = min(req.num_tokens - req.num_computed, budget)
                out.num_tokens[req] = n
                budget -= n
                continue
            if not admitting:
                continue
            if req.wait_for is not None and not self._prompt_cached(req.wait_for):
                continue  # a copy: it takes its prompt from the first copy's blocks once they are cached
            hits = self.blocks.cached_prefix(req)
            if len(self.running) >= self.max_num_seqs or not self.blocks.can_admit(req, hits):
                admitting = not is_aged(req, now)  # an aged request lets no later one take its place
                continue
            self.waiting.remove(req)
            self._admit(req, hits, out)
            if not req.use_cache:  # a whole recompute, outside the budget
                out.num_tokens[req] = req.num_tokens
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            out.num_tokens[req] = n
            budget -= n
        return budget

    @staticmethod
    def _prompt_cached(req: Request) -> bool:
        """Whether the request's full prompt blocks are in the prefix cache, or will never be."""
        return req.status != RequestStatus.RUNNING or req.num_computed >= req.num_prompt_tokens - 1

    def _admit(self, req: Request, hits: list[int], out: SchedulerOutput) -> None:
        """Gives the request its blocks and a row; `_release` takes both back."""
        self.blocks.admit(req, hits)
        req.row = self._free_rows.pop()
        out.admitted.append(req)
        req.status = RequestStatus.RUNNING
        if req.stats.admitted is None:  # the first admission: a resumed request counts its prefix once
            req.stats.admitted = time.perf_counter()
            if req.use_cache:
                req.stats.cached_tokens = req.num_computed
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.prefix_cache_hits += req.num_computed
        self.running.append(req)

    def _make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Blocks for `num_tokens` of `req`, preempting the newest running requests until they fit.
        False when `req` itself had to go."""
        while not self.blocks.grow(req, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            out.num_tokens.pop(victim, None)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.stats.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Takes a request out (finished or failed) and gives its blocks back at once."""
        with self._lock:
            if req in self.running:
                self.running.remove(req)
                self._release(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED

    def drain(self) -> list[Request]:
        """Removes every request (engine shutdown); returns them so their streams can be ended."""
        with self._lock:
            reqs = list(self.waiting) + self.running
            for req in self.running:
                self._release(req)
            for req in reqs:
                req.status = RequestStatus.FINISHED
            self.waiting.clear()
            self.running.clear()
            self._aborts.clear()
            return reqs

    def _release(self, req: Request) -> None:
        """The one place a running request gives back its blocks and its row."""
        self.blocks.release(req)
        self._free_rows.append(req.row)
        req.row = None

    def _take_aborted(self) -> list[Request]:
        if not self._aborts:
            return []
        aborted = [r for r in list(self.waiting) + self.running if r.request_id in self._aborts]
        for req in aborted:
            if req in self.running:
                self.running.remove(req)
                self._release(req)
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED
        self._aborts.clear()  # ids not found had already finished
        return aborted
