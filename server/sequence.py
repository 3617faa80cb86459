"""One request's state inside the engine, and what the engine hands back for it.

`Sequence.append` keeps a `model.generate.OutputText` per request, the same per-token bookkeeping
(EOS, stop strings, streaming detokenization, max_new_tokens) that `model.generate.generate` uses.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.generate import OutputText
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

_ids = itertools.count()

# Why a request ended: the three reasons generation stops on its own, and the two it is stopped.
FINISH_LENGTH, FINISH_EOS, FINISH_STOP = "length", "eos", "stop"
FINISH_ABORT, FINISH_ERROR = "abort", "error"


@dataclass
class RequestStats:
    """Timestamps (time.perf_counter) and counts of one request; the engine fills them in."""

    prompt_tokens: int
    use_cache: bool
    seed: int | None
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # took a slot
    first_token: float | None = None
    finished: float | None = None
    generated_tokens: int = 0

    @property
    def queue_time_s(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_latency_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second from taking a slot to the last token (queue time excluded)."""
        if self.finished is None or self.admitted is None or self.finished <= self.admitted:
            return None
        return self.generated_tokens / (self.finished - self.admitted)


@dataclass
class TokenOutput:
    """One event of a request's stream: a new token, or (token_id None) an abort or an error."""

    request_id: str
    index: int  # 1-based position of the token among the generated ones (0 for a tokenless event)
    token_id: int | None
    text: str  # text this token completed; '' mid-character or while a stop string is undecided
    logprob: float
    special: bool
    finish_reason: str | None  # set on the last event: length, eos, stop, abort or error
    error: str | None = None  # the message when finish_reason == 'error'
    error_type: str | None = None  # what kind of error: generation (default), shutdown, timeout
    stats: RequestStats | None = None  # on the last event
    time: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[TokenOutput], None]


class Sequence:
    """A request from admission to its last token: prompt, generated ids, cache slot, sampler state."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, sink: Sink,
                 *, use_cache: bool = True, device: torch.device | str = "cpu", request_id: str | None = None):
        self.request_id = request_id or f"req-{next(_ids)}"
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.use_cache = use_cache
        self.sink = sink
        self.generator = params.make_generator(device)
        self.slot: int | None = None  # KV-cache slot while running with use_cache
        self.num_cached = 0  # prompt tokens whose keys/values are in the cache (chunked prefill)
        self.finish_reason: str | None = None
        self.stats = RequestStats(prompt_tokens=len(self.prompt_ids), use_cache=use_cache,
                                  seed=None if params.greedy else params.seed)
        self._special_ids = tokenizer.special_ids
        self._text = OutputText(tokenizer, params)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilled(self) -> bool:
        return self.num_cached >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, logprob: float) -> TokenOutput:
        """Records a sampled token and returns its event; sets finish_reason on the last one."""
        now = time.perf_counter()
        if not self.output_ids:
            self.stats.first_token = now
        self.output_ids.append(token_id)
        text = self._text.push(token_id)
        self.finish_reason = self._text.finish_reason  # FINISH_STOP, FINISH_EOS or FINISH_LENGTH when done
        last = self.finished
        self.stats.generated_tokens = len(self.output_ids)
        return TokenOutput(self.request_id, len(self.output_ids), token_id, text, logprob,
                           token_id in self._special_ids, self.finish_reason,
                           stats=self._finish_stats(now) if last else None, time=now)

    def end(self, reason: str, error: str | None = None, error_type: str | None = None) -> TokenOutput:
        """The last event of a request stopped from outside: abort (cancelled) or error."""
        self.finish_reason = reason
        now = time.perf_counter()
        return TokenOutput(self.request_id, 0, None, "", 0.0, False, reason, error=error, error_type=error_type,
                           stats=self._finish_stats(now), time=now)

    def _finish_stats(self, now: float) -> RequestStats:
        self.stats.finished = now
        return self.stats
