"""From sampled tokens to a request's events: detokenization, stop strings, finish reasons, stats.

Sits between the engine core and the API: the engine hands it each sampled token, it returns the
TokenOutput to stream (model.text.OutputText keeps the text state, the same one `generate()` uses).
"""

from __future__ import annotations

import time

from model.text import OutputText
from model.tokenizer import Tokenizer
from server.engine.request import Request, RequestStats, TokenOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special_ids = tokenizer.special_ids

    def start(self, req: Request) -> None:
        req.output = OutputText(self.tokenizer, req.params)

    def append(
        self,
        req: Request,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
        complete: bool = False,
    ) -> TokenOutput:
        """Records a sampled token and returns its event; sets finish_reason on the last one (`complete`: the
        request's grammar is matched, so this token is its last). The first event carries the prompt's
        logprobs when the request asked for them."""
        first = req.num_output_tokens == 0
        now = time.perf_counter()
        if first:
            req.stats.first_token = now
        req.token_ids.append(token_id)
        text = req.output.push(token_id, complete)
        req.finish_reason = req.output.finish_reason  # stop, eos or length once done
        req.stats.generated_tokens = req.num_output_tokens
        return TokenOutput(
            req.request_id,
            req.num_output_tokens,
            token_id,
            text,
            logprob,
            token_id in self._special_ids,
            req.finish_reason,
            stats=self._finish_stats(req, now) if req.finish_reason else None,
            time=now,
            top_logprobs=top,
            prompt_logprobs=self._prompt_logprobs(req) if first else None,
        )

    def end(self, req: Request, reason: str, error: str | None = None, error_type: str | None = None) -> TokenOutput:
        """The last event of a request stopped from outside: abort (cancelled) or error."""
        req.finish_reason = reason
        now = time.perf_counter()
        return TokenOutput(
            req.request_id,
            0,
            None,
            "",
            0.0,
            False,
            reason,
            error=error,
            error_type=error_type,
            stats=self._finish_stats(req, now),
            time=now,
            prompt_logprobs=self._prompt_logprobs(req) if req.num_output_tokens == 0 else None,
        )

    @staticmethod
    def _prompt_logprobs(req: Request):
        return list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None

    @staticmethod
    def _finish_stats(req: Request, now: float) -> RequestStats:
        req.stats.finished = now
        return req.stats
