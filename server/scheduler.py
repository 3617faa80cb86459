"""Which requests run in the next engine step: admission into slots, chunked prefill, aborts.

Thread-safe on the submitting side (`add`, `abort` are called from the HTTP event loop); `schedule`
and `finish` are called by the engine thread only.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from model.kv_cache import KVCache
from server.sequence import Sequence


class QueueFullError(RuntimeError):
    """Every slot is busy and the waiting queue is at its limit: the request is refused now."""


@dataclass
class PrefillChunk:
    seq: Sequence  # a cached request still reading its prompt
    start: int  # first prompt position of this chunk
    end: int  # one past its last position; end == len(prompt) means the first token is sampled now


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)  # prompt chunks to write into their slots
    decode: list[Sequence] = field(default_factory=list)  # cached requests: feed the last token, get the next
    recompute: list[Sequence] = field(default_factory=list)  # use_cache=False: whole sequence again, uncached
    aborted: list[Sequence] = field(default_factory=list)  # cancelled since the last step; slots already freed

    @property
    def sequences(self) -> list[Sequence]:
        """Every request that runs through the model this step (each at most once)."""
        return [c.seq for c in self.prefill] + self.decode + self.recompute

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.end - c.start for c in self.prefill)


# Prompt tokens per step. Smaller keeps the running requests' inter-token latency low while new prompts
# are read (each step carries at most this much prefill); larger reads long prompts in fewer steps.
# 128 was measured best of 64/128/512 for p99 ITL at concurrency 32 on a 2-core CPU (BENCHMARKS.md).
DEFAULT_PREFILL_CHUNK = 128
DEFAULT_MAX_PREFILL_TOKENS = 128


class Scheduler:
    """First come, first served. Up to `max_running` requests hold a slot; up to `max_waiting` more wait.

    Each step every running request advances: cached ones past their prompt decode one token, uncached
    ones recompute, and prompts are read in chunks of at most `prefill_chunk` tokens, with at most
    `max_prefill_tokens` prompt tokens per step in all, so a long prompt never stalls running requests.
    """

    def __init__(self, cache: KVCache, max_running: int, max_waiting: int,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS) -> None:
        if max_running < 1 or max_running > cache.num_slots:
            raise ValueError(f"max_running must be in [1, {cache.num_slots}] (cache slots), got {max_running}")
        if max_waiting < 0 or prefill_chunk < 1 or max_prefill_tokens < 1:
            raise ValueError("max_waiting must be >= 0, prefill_chunk and max_prefill_tokens >= 1")
        self.cache = cache
        self.max_running, self.max_waiting = max_running, max_waiting
        self.prefill_chunk, self.max_prefill_tokens = prefill_chunk, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_pending_aborts(self) -> int:
        return len(self._aborts)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def add(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) + len(self.running) >= self.max_running + self.max_waiting:
                raise QueueFullError(
                    f"the server is at capacity: {len(self.running)} requests running (max {self.max_running}) "
                    f"and {len(self.waiting)} waiting (max {self.max_waiting}); retry later")
            self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        with self._lock:
            out.aborted = self._take_aborted()
            while self.waiting and len(self.running) < self.max_running:
                self._admit(self.waiting.popleft())
            running = list(self.running)
        budget = self.max_prefill_tokens
        for seq in running:
            if not seq.use_cache:
                out.recompute.append(seq)
            elif seq.prefilled:
                out.decode.append(seq)
            elif budget > 0:
                n = min(self.prefill_chunk, len(seq.prompt_ids) - seq.num_cached, budget)
                out.prefill.append(PrefillChunk(seq, seq.num_cached, seq.num_cached + n))
                budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        """Takes a running request out and frees its slot at once."""
        with self._lock:
            if seq in self.running:
                self.running.remove(seq)
                self._release(seq)

    def drain(self) -> list[Sequence]:
        """Removes every request (engine shutdown); returns them so their streams can be ended."""
        with self._lock:
            seqs = list(self.waiting) + self.running
            for seq in self.running:
                self._release(seq)
            self.waiting.clear()
            self.running.clear()
            self._aborts.clear()
            return seqs

    def _admit(self, seq: Sequence) -> None:
        if seq.use_cache:
            seq.slot = self.cache.allocate()
        seq.stats.admitted = time.perf_counter()
        self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None

    def _take_aborted(self) -> list[Sequence]:
        if not self._aborts:
            return []
        aborted = [s for s in list(self.waiting) + self.running if s.request_id in self._aborts]
        for seq in aborted:
            if seq in self.running:
                self.running.remove(seq)
                self._release(seq)
            else:
                self.waiting.remove(seq)
        self._aborts.clear()  # ids not found had already finished
        return aborted
