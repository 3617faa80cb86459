"""Exact speculative decoding with n-gram drafts (prompt lookup).

Drafts: the longest recent n-gram of a sequence (prompt and output, `prompt_lookup_max` tokens down to
`prompt_lookup_min`) is looked up earlier in the sequence, and the tokens that followed its latest
earlier occurrence become the draft, up to K of them. Each request keeps an index of its n-grams,
extended by the tokens it gained since the last look-up, so a look-up costs a few dictionary reads.

Verification (model_runner.py, sampler.py) gives the target's own token at each of the K + 1
positions, the one decoding without speculation would have produced there; a draft token is accepted
while it equals that token. The output is therefore unchanged, token for token and logprob for logprob.

Adaptive: a request whose drafts do not pay for their extra rows stops drafting for a while
(`Drafter.record`), so text that does not repeat itself pays (almost) nothing; how much acceptance
pays depends on the batch (`break_even_rate`), from measured step costs (BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.request import Request

# When drafting pays. A step over N rows of B sequences costs about a + b * N: a fixed part (the
# weights read once, attention per sequence) and a part per row. Drafting k tokens adds k * b; each
# accepted token saves its request a step, worth (a + b * B) / B. So a request's drafts pay while
# their acceptance rate exceeds b * B / (a + b * B) = B / (B + a / b). The fixed part in rows, a / b,
# is measured (BENCHMARKS.md, "Speculative decoding: when drafts pay"): about 7 rows alone, growing
# by about half a row per sequence in the batch.
FIXED_ROWS_ALONE, FIXED_ROWS_PER_SEQUENCE = 7.0, 0.5
PROBE_TOKENS = 1  # the draft length after a pause (and first), until a draft pays again: one row at stake
FIRST_PAUSE, LONGEST_PAUSE = 4, 64  # steps without drafting after a draft that did not pay; doubled in a row


def break_even_rate(batch: int) -> float:
    """The acceptance rate above which drafting pays, with `batch` sequences in the step."""
    return batch / (batch + FIXED_ROWS_ALONE + FIXED_ROWS_PER_SEQUENCE * batch)


@dataclass
class SpecDecodeStats:
    """Running totals since start, read by /metrics (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # verifications of a draft
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def counters(self) -> dict[str, int | list[int]]:
        """For /metrics, under vLLM's names."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position)}


@dataclass
class DraftState:
    """One request's drafting state, kept by the Drafter."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    indexed: int = 0  # leading tokens of the sequence entered into `index`
    matches: dict[int, int] = field(default_factory=dict)  # n -> end of the suffix n-gram's previous occurrence
    rate: float | None = None  # acceptance rate of its recent drafts (each halves the weight of those before)
    probing: bool = True  # draft PROBE_TOKENS only: the first draft, and the first after a pause
    pause: int = 0  # steps left without drafting
    next_pause: int = FIRST_PAUSE  # the pause after the next draft that does not pay


class Drafter:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.stats = SpecDecodeStats(accepted_per_position=[0] * num_speculative_tokens)

    def draft_all(self, running: list[Request]) -> None:
        """Sets the draft of every running request (empty unless it decodes and may speculate)."""
        for req in running:
            decoding = req.speculative and req.num_computed == req.num_tokens - 1
            req.draft = self.propose(req) if decoding else []

    def propose(self, req: Request) -> list[int]:
        """The draft for a decoding request's next step (possibly empty): at most K tokens, and never
        more than its remaining tokens less the one the step samples anyway."""
        state = req.draft_state
        if state is None:
            state = req.draft_state = DraftState()
        if state.pause:
            state.pause -= 1
            return []
        limit = min(PROBE_TOKENS if state.probing else self.k, req.params.max_new_tokens - req.num_output_tokens - 1)
        if limit <= 0:
            return []
        tokens = req.token_ids
        self._extend(state, tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            end = state.matches.get(n)
            if end is not None:
                draft = tokens[end + 1:end + 1 + limit]
                period = len(tokens) - 1 - end  # the match overlaps the end: the run repeats with this period
                while len(draft) < limit:
                    draft.append(draft[len(draft) - period])
                return draft
        return []

    def _extend(self, state: DraftState, tokens: list[int]) -> None:
        """Enters the n-grams ending at each new token; for the last one, remembers where each of its
        suffix n-grams occurred before (the candidates for the next draft)."""
        for end in range(state.indexed, len(tokens)):
            matches = {}
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                gram = tuple(tokens[end - n + 1:end + 1])
                previous = state.index.get(gram)
                if previous is not None:
                    matches[n] = previous
                state.index[gram] = end
            state.matches = matches
        state.indexed = len(tokens)

    def record(self, req: Request, drafted: int, accepted: int, batch: int) -> None:
        """A verified draft, in a step of `batch` sequences: the counters, and whether the request
        goes on drafting (full drafts while they pay; else a pause, doubled each time in a row)."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        req.stats.draft_tokens += drafted
        req.stats.accepted_draft_tokens += accepted
        state = req.draft_state
        rate = accepted / drafted
        state.rate = rate if state.rate is None else (state.rate + rate) / 2
        if state.rate >= break_even_rate(batch):
            state.probing, state.next_pause = False, FIRST_PAUSE
        else:
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, LONGEST_PAUSE)
            state.probing, state.rate = True, None


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many leading draft tokens equal the target's own tokens at their positions (targets[i] is
    the token the target picks after draft[:i])."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return m
