"""A generated sequence's text, token by token: streaming detokenization (never a torn character),
stop strings (found across tokens, never leaked), EOS and max_new_tokens. The plain `generate()`
and the serving engine's output processor both keep one `OutputText` per sequence."""

from __future__ import annotations

from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

# Why a sequence ended, the one set of names for it: the three reasons generation stops on its own, decided
# here, and the two a serving engine stops it for (cancelled, or failed).
FINISH_LENGTH, FINISH_EOS, FINISH_STOP = "length", "eos", "stop"
FINISH_ABORT, FINISH_ERROR = "abort", "error"


class StopMatcher:
    """Finds stop strings in streamed text, even when they span tokens, and never lets one leak:
    text that could still be the start of a stop string is held back until it is decided."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(stop)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Text now safe to emit. After a match, `matched` is set and the rest is dropped."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        self._held += text
        hits = [(self._held.find(s), s) for s in self.stop if s in self._held]
        if hits:
            at, s = min(hits)
            self.matched = s
            out, self._held = self._held[:at], ""
            return out
        keep = max((self._longest_prefix_suffix(s) for s in self.stop), default=0)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        out, self._held = ("" if self.matched else self._held), ""
        return out

    def _longest_prefix_suffix(self, stop: str) -> int:
        for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
            if self._held.endswith(stop[:n]):
                return n
        return 0


class OutputText:
    """One sequence's text and finish reason (FINISH_EOS, FINISH_STOP or FINISH_LENGTH once it is done).
    Any of the tokenizer's EOS ids ends it (a checkpoint may name several: Llama 3's do), and so does a
    completed grammar (structured output), which allows nothing but EOS after it: FINISH_EOS as well."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.params, self.eos_token_ids = params, frozenset(tokenizer.eos_token_ids)
        self._decoder, self._stops = tokenizer.stream(skip_special=True), StopMatcher(params.stop)
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def push(self, token_id: int, complete: bool = False) -> str:
        """The text this token completes ('' mid-character or while a stop string may be starting).
        `complete`: the sequence's grammar is matched and allows nothing more, so it ends here as at an EOS."""
        self.num_tokens += 1
        eos = token_id in self.eos_token_ids and not self.params.ignore_eos
        text = "" if eos else self._stops.push(self._decoder.push(token_id))
        eos = eos or complete
        last = eos or self._stops.matched is not None or self.num_tokens >= self.params.max_new_tokens
        if last and self._stops.matched is None:  # release what was held back: a torn character, a stop prefix
            text += self._stops.push(self._decoder.flush())
            text += self._stops.flush()
        if last:
            stopped = self._stops.matched is not None
            self.finish_reason = FINISH_STOP if stopped else FINISH_EOS if eos else FINISH_LENGTH
        return text
