"""One request inside the engine, and the events the engine hands back for it."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from model.grammar import GrammarMatcher
from model.sampling import SamplingParams

# Why a request ended: named once, in model.text; imported from here by the engine's modules.
from model.text import FINISH_ABORT, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP  # noqa: F401

_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holding no blocks (new, or preempted)
    RUNNING = "running"  # holding blocks, scheduled every step
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Timestamps (time.perf_counter) and counts of one request; the engine fills them in."""

    prompt_tokens: int
    use_cache: bool
    seed: int | None
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # first scheduled
    first_token: float | None = None
    finished: float | None = None
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache at admission
    preemptions: int = 0
    draft_tokens: int = 0  # speculative draft tokens verified for it
    accepted_draft_tokens: int = 0  # of those, accepted (each a token it got without a step of its own)

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
        """Generated tokens per second from admission to the last token (queue time excluded)."""
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
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely tokens here, when asked for
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first event, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PromptLogprob:
    """How likely the model found one prompt token, given the tokens before it."""

    position: int  # its position in the prompt (1 or more: the first token has no context)
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # the most likely tokens at that position, when asked for


Sink = Callable[[TokenOutput], None]


class Request:
    """A request from submission to its last token: its tokens so far, its blocks, how far the cache
    holds them, and where its events go."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        sink: Sink,
        *,
        use_cache: bool = True,
        cache_salt: str | None = None,
        request_id: str | None = None,
        speculative: bool = True,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.request_id = request_id or f"req-{next(_ids)}"
        self.token_ids = list(prompt_ids)  # the prompt, then every generated token
        self.num_prompt_tokens = len(prompt_ids)
        self.params, self.seed, self.sink = params, seed, sink
        self.use_cache, self.cache_salt = use_cache, cache_salt
        self.status = RequestStatus.WAITING
        self.row: int | None = None  # its row in the runner's and sampler's buffers while running (the scheduler's)
        self.block_ids: list[int] = []  # its block table: position p lives in block_ids[p // block_size]
        self.num_computed = 0  # leading tokens whose keys/values its blocks hold
        self.block_hashes: list[int] = []  # prefix-cache keys of its first full blocks (a hash chain)
        self.registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.finish_reason: str | None = None
        self.stats = RequestStats(
            prompt_tokens=len(prompt_ids), use_cache=use_cache, seed=None if params.greedy else seed
        )
        self.output = None  # the output processor's per-request state
        self.prompt_logprobs: list[PromptLogprob] = []  # as computed, when the request asked for them
        self.wait_for: Request | None = None  # admitted only once that request's prompt is in the cache
        self.speculative = speculative and use_cache  # may draft, when the engine speculates
        self.draft: list[int] = []  # tokens proposed for its next step (the drafter's), verified there
        self.draft_state = None  # the drafter's per-request state (server/engine/speculative.py)
        self.grammar = grammar  # structured output: where its tokens so far stand in its grammar; None: free text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, blocks={len(self.block_ids)})"
        )
