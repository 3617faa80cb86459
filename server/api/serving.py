"""What every route shares: the server's limits, the error answer, sampling parameters from a request,
the engine requests one HTTP request owns (`Generation`), and Server-Sent Events. The routes' own
logic is in serving_tgi, serving_completions and serving_chat."""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from model.generate import PromptError
from model.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from server.api.errors import error_body
from server.api.metrics import Metrics
from server.api.protocol import ErrorResponse
from server.engine import (FINISH_ABORT, FINISH_ERROR, AsyncSink, Engine, EngineStoppedError, QueueFullError,
                           TokenOutput)

log = logging.getLogger("kvserve.serving")
SAMPLING_EPS = 1e-5
LONG_TEXT = 16_384  # characters: longer prompts are tokenized off the event loop
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ERROR_STATUS = {"shutdown": 503, "timeout": 504}  # error_type of a failed generation -> status; else 500
GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Limits:
    """What one request may ask of this server. Each refusal is a 4xx naming the flag that sets the limit
    and is counted in /metrics as kvserve:request_rejected_total{reason=...}."""

    max_body_bytes: int = 2_000_000  # --max-body-bytes: larger bodies get 413 before they are parsed
    max_input_tokens: int | None = None  # --max-input-tokens (after `truncate`); None: the context less one
    max_new_tokens: int | None = None  # --max-new-tokens; None: what the context leaves
    max_stop_sequences: int = 4  # --max-stop-sequences, as TGI
    max_stop_length: int = 256  # --max-stop-length, characters per stop string
    request_timeout: float | None = None  # --request-timeout seconds: the default deadline and the most one may ask
    max_n: int = 16  # --max-n: choices per prompt (OpenAI's n)
    max_best_of: int = 16  # --max-best-of: sequences generated per prompt to pick from (best_of)
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: alternatives per token (logprobs, top_n_tokens, ...)
    max_prompts: int = 64  # --max-prompts: prompts in one completions request

    def deadline(self, requested: float | None) -> float | None:
        """Seconds this request may run: what it asked for, at most the server's limit."""
        given = [t for t in (requested, self.request_timeout) if t is not None]
        return min(given) if given else None

    def check_stop(self, stop: list[str], field: str) -> None:
        if len(stop) > self.max_stop_sequences:
            raise APIError(422, f"{field}: {len(stop)} stop sequences; this server takes at most "
                           f"{self.max_stop_sequences} (--max-stop-sequences)", "validation", reason="stop_sequences")
        longest = max(stop, key=len, default="")
        if len(longest) > self.max_stop_length:
            raise APIError(422, f"{field}: a stop sequence of {len(longest)} characters; this server takes at "
                           f"most {self.max_stop_length} (--max-stop-length)", "validation", reason="stop_sequences")

    def check_prompt(self, prompt_len: int) -> None:
        if self.max_input_tokens is not None and prompt_len > self.max_input_tokens:
            raise APIError(422, f"the prompt has {prompt_len} tokens; this server takes at most "
                           f"{self.max_input_tokens} (--max-input-tokens)", "validation", reason="prompt_too_long")

    def check_new_tokens(self, max_new_tokens: int, field: str) -> None:
        if self.max_new_tokens is not None and max_new_tokens > self.max_new_tokens:
            raise APIError(422, f"{field} ({max_new_tokens}) is above this server's limit of "
                           f"{self.max_new_tokens} (--max-new-tokens)", "validation", reason="max_new_tokens")

    def check_count(self, field: str, value: int | None, limit_name: str) -> None:
        """n, best_of, logprobs and their kin against the flag of the same name."""
        limit = getattr(self, limit_name)
        if value is not None and value > limit:
            flag = "--" + limit_name.replace("_", "-")
            raise APIError(422, f"{field} ({value}) is above this server's limit of {limit} ({flag})", "validation",
                           reason=limit_name.removeprefix("max_"))


class APIError(Exception):
    """An answer other than 200, in TGI's shape: {"error": ..., "error_type": ...}. `reason`, when set,
    counts it in /metrics as a refusal (kvserve:request_rejected_total{reason=...})."""

    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers
        self.reason = reason

    def response(self, openai: bool = False) -> JSONResponse:
        """TGI's {"error": message, "error_type": type}, or with `openai` OpenAI's
        {"error": {"message", "type", "param", "code"}}, which its clients show."""
        return JSONResponse(error_body(self.status, self.message, self.error_type, openai), status_code=self.status,
                            headers=self.headers)


def sampling_params(vocab_size: int, **kw) -> SamplingParams:
    """SamplingParams from a request's fields. Also folds values out of the sampler's range into their
    limit, as vLLM does, unchanged in meaning: a temperature below SAMPLING_EPS is greedy, a top_p below
    it keeps the best token only, a top_k above the vocabulary keeps every token, and a repetition
    penalty beyond [SAMPLING_EPS, 1/SAMPLING_EPS] (which would overflow float32 logits to inf) is held
    at that bound, where it already decides alone."""
    if 0 < kw["temperature"] < SAMPLING_EPS:
        kw["temperature"] = 0.0
    kw["top_p"] = max(kw["top_p"], SAMPLING_EPS)
    kw["top_k"] = min(kw["top_k"], vocab_size)
    kw["repetition_penalty"] = min(max(kw["repetition_penalty"], SAMPLING_EPS), 1 / SAMPLING_EPS)
    try:
        return SamplingParams(**kw)
    except SamplingError as e:
        raise APIError(422, str(e), "validation") from e


def seed_for(sampling: bool, seed: int | None) -> int | None:
    """A sampled request without a seed gets a random one, reported back so it can be replayed."""
    return seed if seed is not None or not sampling else random.getrandbits(63)


def copies_of(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n requests of one prompt: copy i > 0 samples with a seed derived from the first's (greedy copies
    are alike anyway), so n copies give n samples, and the same n again for the same seed."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [params] + [replace(params, seed=(params.seed + i * GOLDEN) % 2**63) for i in range(1, n)]


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int, field: str = "logit_bias") -> tuple:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id is a 422."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(422, f"{field}: {key!r} is not a token id in [0, {vocab_size})", "validation")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


async def encode(engine: Engine, text: str) -> list[int]:
    if len(text) > LONG_TEXT:
        return await asyncio.to_thread(engine.tokenizer.encode, text)
    return engine.tokenizer.encode(text)


class Generation:
    """The engine requests one HTTP request owns: for each prompt, its copies (n, best_of), choice k
    being copy k % copies of prompt k // copies. All are submitted at construction (so a refusal is an
    HTTP status, not a broken stream), consumed together by `events`, and cancelled together when the
    client disconnects or when `timeout` seconds have passed (then each one's last event is an error of
    type 'timeout')."""

    def __init__(self, engine: Engine, metrics: Metrics, prompts: list[list[int]], params: list[SamplingParams],
                 use_cache: bool, *, timeout: float | None = None, max_tokens_field: str = "max_new_tokens",
                 cache_salt: str | None = None, speculative: bool = True) -> None:
        """params: one per copy of each prompt (the same list for every prompt)."""
        self.engine, self.metrics, self.prompts, self.params, self.use_cache = engine, metrics, prompts, params, use_cache
        self.timeout, self.expired = timeout, False
        self.copies = len(params)
        self._events: asyncio.Queue = asyncio.Queue()
        sink = AsyncSink(asyncio.get_running_loop(), self._events)
        self.request_ids: list[str] = []
        try:
            for ids in prompts:
                if self.copies == 1:
                    self.request_ids.append(engine.submit(ids, params[0], sink, use_cache=use_cache,
                                                          cache_salt=cache_salt, speculative=speculative))
                else:
                    self.request_ids += engine.submit_copies(ids, params, [sink] * self.copies, use_cache=use_cache,
                                                             cache_salt=cache_salt, speculative=speculative)
        except PromptError as e:
            self.cancel()
            raise APIError(422, str(e).replace("max_new_tokens", max_tokens_field), "validation",
                           reason="context_length") from e
        except QueueFullError as e:
            self.cancel()
            raise APIError(429, str(e), "overloaded", headers={"Retry-After": "1"}, reason="queue_full") from e
        except EngineStoppedError as e:
            self.cancel()
            raise APIError(503, str(e), "unavailable", headers={"Retry-After": "5"}, reason="shutting_down") from e
        self._choice = {rid: k for k, rid in enumerate(self.request_ids)}
        self._open = set(self.request_ids)

    @property
    def done(self) -> bool:
        return not self._open

    def cancel(self) -> None:
        for rid in getattr(self, "_open", self.request_ids):
            self.engine.abort(rid)

    async def events(self, request: Request) -> AsyncIterator[tuple[int, TokenOutput]]:
        """(choice, event) pairs as they arrive, until every choice has its last event."""
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(request))
        deadline = asyncio.get_running_loop().call_later(self.timeout, self._expire) if self.timeout else None
        previous: dict[int, TokenOutput] = {}
        try:
            while self._open:
                out = await self._events.get()
                k = self._choice[out.request_id]
                if out.token_id is not None:
                    self.metrics.on_token(out, previous.get(k), self.use_cache)
                if out.finished:
                    self._open.discard(out.request_id)
                    if self.expired and out.finish_reason == FINISH_ABORT:  # counted as an error, not an abort
                        out = replace(out, finish_reason=FINISH_ERROR, error_type="timeout", error=(
                            f"the request ran past its deadline of {self.timeout:g} s "
                            "(parameters.timeout / --request-timeout)"))
                    self.metrics.on_finish(out.finish_reason, len(self.prompts[k // self.copies]), out.stats,
                                           self.use_cache)
                previous[k] = out
                yield k, out
        finally:
            watcher.cancel()
            if deadline is not None:
                deadline.cancel()
            if self._open:  # the consumer left early: the client is gone
                for rid in self._open:
                    self.engine.abort(rid)
                    prompt = self.prompts[self._choice[rid] // self.copies]
                    self.metrics.on_finish(FINISH_ABORT, len(prompt), None, self.use_cache)
                self._open.clear()

    async def collect(self, request: Request) -> list[list[TokenOutput]]:
        """Every choice's events, in choice order; a failed or cancelled choice is an APIError."""
        outs: list[list[TokenOutput]] = [[] for _ in self.request_ids]
        async for k, out in self.events(request):
            outs[k].append(out)
        for events in outs:
            final = events[-1]
            if final.finish_reason == FINISH_ERROR:
                error_type = final.error_type or "generation"
                raise APIError(ERROR_STATUS.get(error_type, 500), final.error or "generation failed", error_type)
            if final.finish_reason == FINISH_ABORT:
                raise APIError(503, "the request was cancelled", "cancelled")
        return outs

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancel()

    def _expire(self) -> None:
        if self._open:
            self.expired = True
            self.metrics.on_rejected("timeout")
            self.cancel()


def tokens_of(outs: list[TokenOutput]) -> list[TokenOutput]:
    """A choice's token events (a scored prompt's only event carries none)."""
    return [o for o in outs if o.token_id is not None]


def error_event(out: TokenOutput, openai: bool = False) -> str:
    """A failed request's last event, in TGI's error shape or (`openai`) OpenAI's."""
    error = APIError(ERROR_STATUS.get(out.error_type or "generation", 500), out.error or "generation failed",
                     out.error_type or "generation")
    return "data: " + error.response(openai).body.decode() + "\n\n"


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_response(events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    """`gen` is cancelled once the response is over, also when the client left before its first event
    (then `events` never started, so its own cleanup never runs)."""
    return StreamingResponse(guarded(events), media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(gen.cancel))


async def guarded(events: AsyncIterator[str], error_type: str = "generation") -> AsyncIterator[str]:
    """A failure inside a stream becomes its last event instead of a torn connection."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - anything here must reach the client as an error event
        log.exception("stream failed")
        yield sse(ErrorResponse(error=f"{type(e).__name__}: {e}", error_type=error_type))
