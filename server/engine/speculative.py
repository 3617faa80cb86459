"""Exact speculative decoding with n-gram drafts (prompt lookup).

Drafts: the longest recent n-gram of a sequence (prompt and output, `prompt_lookup_max` tokens down to
`prompt_lookup_min`) is looked up earlier in the sequence, and the tokens that followed its latest
earlier occurrence become the draft. Each request keeps an index of its n-grams (each n-gram packed
into one integer, so the index holds no tuples for the garbage collector to traverse), extended by the
tokens it gained since the last look-up, so a look-up costs a few dictionary reads. The engine's n-gram
history (ngram_history.py), shared by the requests, offers a second draft: what followed the last n
tokens (`--ngram-history`) in any earlier request of the same cache_salt, taken first when there is one.

Verification (model_runner.py, sampler.py) gives the target's own token at each of the K + 1
positions, the one decoding without speculation would have produced there; a draft token is accepted
while it equals that token. The output is therefore unchanged, token for token and logprob for logprob.

Adaptive: a draft token costs a query row whether or not it is accepted. Each request estimates `p`,
the chance that its next draft token is accepted given that the ones before it were, from its
verified drafts and, while it does not draft, from *shadow* drafts: the token it would have drafted,
compared with the token the step produced, at no cost in rows. The j-th draft token pays when p ** j
exceeds the break-even rate of the batch (`break_even_rate`, from measured step costs, BENCHMARKS.md),
so a request drafts as many tokens as pay (`draft_length`): none on text that does not repeat itself,
a few in a large batch, up to K alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from server.engine.counters import SpecDecodeCounters
from server.engine.ngram_history import HISTORY_CAPACITY, NgramHistory
from server.engine.request import Request

# When drafting pays. A step over N rows of B sequences costs about a + b * N: a fixed part (the
# weights read once, attention per sequence) and a part per row. A draft token adds a row, b; an
# accepted one saves its request a step, worth (a + b * B) / B. So a draft token pays while the
# chance it is accepted exceeds b * B / (a + b * B) = B / (B + a / b). The fixed part in rows, a / b,
# is measured (BENCHMARKS.md, "Speculative decoding: when drafts pay"): about 7 rows alone, growing
# by about half a row per sequence in the batch.
FIXED_ROWS_ALONE, FIXED_ROWS_PER_SEQUENCE = 7.0, 0.5
DECAY = 0.8  # each decided draft token keeps this fraction of the evidence before it
PRIOR_TRIALS = 5.0  # a request starts as if 5 draft tokens had been rejected: it drafts once shadows hit
SHIFT = 32  # bits per token id in a packed n-gram key


def break_even_rate(batch: int) -> float:
    """The acceptance chance above which a draft token pays, with `batch` sequences in the step."""
    return batch / (batch + FIXED_ROWS_ALONE + FIXED_ROWS_PER_SEQUENCE * batch)


def draft_length(p: float, break_even: float, limit: int) -> int:
    """How many draft tokens pay when each is accepted with chance `p` given the ones before it: the
    j-th is accepted with chance p ** j and pays while that exceeds `break_even` (at most `limit`)."""
    if p <= break_even or limit <= 0:
        return 0
    if p >= 1.0:
        return limit
    return min(limit, int(math.log(break_even) / math.log(p) + 1e-9))


@dataclass
class SpecDecodeStats:
    """Running totals since start, read by /metrics (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # verifications of a draft
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def snapshot(self) -> SpecDecodeCounters:
        """The totals now, for /metrics."""
        return SpecDecodeCounters(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(self.accepted_per_position),
        )


@dataclass
class DraftState:
    """One request's drafting state, kept by the Drafter."""

    index: dict[int, int] = field(default_factory=dict)  # packed n-gram -> end of its latest occurrence
    indexed: int = 0  # leading tokens of the sequence entered into `index`
    match: int | None = None  # end of the previous occurrence of the longest suffix n-gram found (None: none)
    hits: float = 0.0  # draft tokens accepted (verified or shadow), each observation decaying the ones before
    trials: float = PRIOR_TRIALS  # draft tokens whose acceptance was decided, decayed alike
    shadow: int | None = None  # the token it would have drafted at position `shadow_at`, had it drafted
    shadow_at: int = 0
    learned: int = 0  # positions before this have had their followers entered into the shared history

    @property
    def acceptance(self) -> float:
        """The chance that its next draft token is accepted, given the ones before it."""
        return self.hits / self.trials

    def observe(self, accepted: int, decided: int) -> None:
        """`decided` draft tokens in a row were accepted or rejected: the first `accepted` of them accepted."""
        for i in range(decided):
            self.hits = DECAY * self.hits + (i < accepted)
            self.trials = DECAY * self.trials + 1


class Drafter:
    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int, history_n: int = 0
    ) -> None:
        """history_n: n of the n-gram history shared by the requests (0: each drafts from its own tokens only)."""
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.history = NgramHistory(history_n, HISTORY_CAPACITY) if history_n else None
        self.stats = SpecDecodeStats(accepted_per_position=[0] * num_speculative_tokens)

    def draft_all(self, running: list[Request]) -> None:
        """Sets the draft of every running request (empty unless it decodes, may speculate and its
        drafts pay in a batch of this many sequences)."""
        break_even = break_even_rate(len(running))
        for req in running:
            decoding = req.speculative and req.num_computed == req.num_tokens - 1
            req.draft = self.propose(req, break_even) if decoding else []

    def propose(self, req: Request, break_even: float) -> list[int]:
        """The draft for a decoding request's next step (possibly empty): as many tokens as pay, at most
        K, and never more than its remaining tokens less the one the step samples anyway."""
        state = req.draft_state
        if state is None:
            state = req.draft_state = DraftState()
        tokens = req.token_ids
        if state.shadow is not None and len(tokens) > state.shadow_at:  # last step's would-be draft, scored
            state.observe(int(tokens[state.shadow_at] == state.shadow), 1)
        state.shadow = None
        self._extend(state, tokens)
        if self.history is not None:
            state.learned = self.history.learn(req.cache_salt, tokens, state.learned)
        limit = min(self.k, req.params.max_new_tokens - req.num_output_tokens - 1)
        length = draft_length(state.acceptance, break_even, limit)
        if length == 0:
            if limit > 0:
                would_draft = self._candidate(req, tokens, 1)
                if would_draft:
                    state.shadow, state.shadow_at = would_draft[0], len(tokens)
            return []
        return self._candidate(req, tokens, length)

    def _candidate(self, req: Request, tokens: list[int], length: int) -> list[int]:
        """Up to `length` draft tokens: what followed the sequence's last n tokens in the shared history
        when it knows them (each next one looked up by the n before it; it stops where the history does
        not know them), else what followed the latest earlier occurrence of its longest suffix n-gram in
        its own tokens. The history's draft wins even when shorter: its keys hold more context, and where
        it stops, the continuation was not what followed before (taking the longer of the two measured
        slower)."""
        if self.history is not None:
            shared = self.history.follow(req.cache_salt, tokens, length)
            if shared:
                return shared
        end = req.draft_state.match
        if end is None:
            return []
        own = tokens[end + 1 : end + 1 + length]
        period = len(tokens) - 1 - end  # the match overlaps the end: the run repeats with this period
        while len(own) < length:
            own.append(own[len(own) - period])
        return own

    def _extend(self, state: DraftState, tokens: list[int]) -> None:
        """Enters the n-grams ending at each new token; for the last one, remembers where its longest
        suffix n-gram occurred before (the candidate for the next draft)."""
        index, min_n, max_n = state.index, self.min_n, self.max_n
        match = state.match
        for end in range(state.indexed, len(tokens)):
            key, match = 1, None
            for n in range(1, min(max_n, end + 1) + 1):
                key = (key << SHIFT) | tokens[end - n + 1]  # a leading 1, then the n tokens: unique per n-gram
                if n >= min_n:
                    previous = index.get(key)
                    if previous is not None:
                        match = previous
                    index[key] = end
        state.match, state.indexed = match, len(tokens)

    def finished(self, req: Request) -> None:
        """A request ended: the shared history learns its tokens since its last draft."""
        if self.history is not None and req.draft_state is not None:
            req.draft_state.learned = self.history.learn(req.cache_salt, req.token_ids, req.draft_state.learned)

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verified draft: the counters, and its request's acceptance estimate (the accepted tokens
        and the first rejected one were decided; the tokens after a rejection were not). The request's
        own count of accepted tokens grows as they are appended (the engine's `_update`): a stop string
        or EOS inside an accepted draft drops the tokens after it."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        req.stats.draft_tokens += drafted
        req.draft_state.observe(accepted, accepted + (accepted < drafted))


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many leading draft tokens equal the target's own tokens at their positions (targets[i] is
    the token the target picks after draft[:i])."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return m
