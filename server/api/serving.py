"""What the routes do: turn TGI / OpenAI requests into engine requests, consume the engine's async
stream (cancelling it when the client goes away), and shape JSON answers and Server-Sent Events."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from model.generate import PromptError
from model.sampling import SamplingError, SamplingParams
from server.api.attention_view import attention_of_generation
from server.engine import Engine, EngineStoppedError, QueueFullError
from server.api.metrics import Metrics
from server.api.protocol import (AttentionWeights, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                 PromptTokensDetails,
                             CompletionResponse, Details, ErrorResponse, GenerateParameters, GenerateRequest,
                             GenerateResponse, StreamDetails, StreamResponse, Token, Usage)
from server.engine import FINISH_ABORT, FINISH_EOS, FINISH_ERROR, FINISH_STOP, TokenOutput

log = logging.getLogger("kvserve.serving")
DEFAULT_MAX_NEW_TOKENS = 100  # TGI's default, cut to what the context leaves
SAMPLING_EPS = 1e-5
LONG_TEXT = 16_384  # characters: longer prompts are tokenized off the event loop
TGI_FINISH = {"length": "length", FINISH_EOS: "eos_token", FINISH_STOP: "stop_sequence"}
OPENAI_FINISH = {"length": "length", FINISH_EOS: "stop", FINISH_STOP: "stop"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ERROR_STATUS = {"shutdown": 503, "timeout": 504}  # error_type of a failed generation -> status; else 500


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


class APIError(Exception):
    """An answer other than 200, in TGI's shape: {"error": ..., "error_type": ...}. `reason`, when set,
    counts it in /metrics as a refusal (kvserve:request_rejected_total{reason=...})."""

    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers
        self.reason = reason

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.message, error_type=self.error_type).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _params(vocab_size: int, **kw) -> SamplingParams:
    """Also folds values out of the sampler's range into their limit, as vLLM does, unchanged in meaning:
    a temperature below SAMPLING_EPS is greedy, a top_p below it keeps the best token only, a top_k
    above the vocabulary keeps every token, and a repetition penalty beyond [SAMPLING_EPS, 1/SAMPLING_EPS]
    (which would overflow float32 logits to inf) is held at that bound, where it already decides alone."""
    if 0 < kw["temperature"] < SAMPLING_EPS:
        kw["temperature"] = 0.0
    kw["top_p"] = max(kw["top_p"], SAMPLING_EPS)
    kw["top_k"] = min(kw["top_k"], vocab_size)
    kw["repetition_penalty"] = min(max(kw["repetition_penalty"], SAMPLING_EPS), 1 / SAMPLING_EPS)
    try:
        return SamplingParams(**kw)
    except SamplingError as e:
        raise APIError(422, str(e), "validation") from e


def _seed_for(sampling: bool, seed: int | None) -> int | None:
    """A sampled request without a seed gets a random one, reported back so it can be replayed."""
    return seed if seed is not None or not sampling else random.getrandbits(63)


def tgi_sampling_params(p: GenerateParameters, prompt_len: int, engine: Engine,
                        limits: Limits) -> SamplingParams:
    """TGI's rule: sampling happens when do_sample is true, or when temperature (!= 1), top_k or
    top_p (< 1) is given; otherwise decoding is greedy and those fields are ignored. A missing
    max_new_tokens is min(100, context - prompt length, --max-new-tokens)."""
    sampling = p.do_sample or p.temperature not in (None, 1.0) or p.top_k is not None or p.top_p not in (None, 1.0)
    cap = limits.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    max_new = p.max_new_tokens or max(1, min(DEFAULT_MAX_NEW_TOKENS, engine.context_length - prompt_len, cap))
    limits.check_new_tokens(max_new, "parameters.max_new_tokens")
    return _params(engine.model_config.vocab_size, max_new_tokens=max_new,
                   temperature=(p.temperature or 1.0) if sampling else 0.0,
                   top_k=(p.top_k or 0) if sampling else 0, top_p=(p.top_p or 1.0) if sampling else 1.0,
                   repetition_penalty=p.repetition_penalty or 1.0, seed=_seed_for(sampling, p.seed),
                   stop=tuple(p.stop), ignore_eos=p.ignore_eos)


def openai_sampling_params(r: CompletionRequest, engine: Engine, limits: Limits) -> SamplingParams:
    """OpenAI's rule: temperature defaults to 1 (sampling); temperature 0 is greedy."""
    temperature = 1.0 if r.temperature is None else r.temperature
    limits.check_new_tokens(r.max_tokens or 16, "max_tokens")
    return _params(engine.model_config.vocab_size, max_new_tokens=r.max_tokens or 16, temperature=temperature,
                   top_k=r.top_k or 0, top_p=r.top_p or 1.0, repetition_penalty=r.repetition_penalty or 1.0,
                   seed=_seed_for(temperature > 0, r.seed), stop=tuple(r.stop_list), ignore_eos=r.ignore_eos)


class Generation:
    """One engine request owned by a handler: submitted at construction (so a refusal is an HTTP
    status, not a broken stream), consumed by `events`, cancelled when the client disconnects or when
    `timeout` seconds have passed (then its last event is an error of type 'timeout')."""

    def __init__(self, engine: Engine, metrics: Metrics, prompt_ids: list[int], params: SamplingParams,
                 use_cache: bool, *, timeout: float | None = None, max_tokens_field: str = "max_new_tokens",
                 cache_salt: str | None = None) -> None:
        self.metrics, self.prompt_ids, self.params, self.use_cache = metrics, prompt_ids, params, use_cache
        self.timeout, self.expired = timeout, False
        try:
            self.stream = engine.stream(prompt_ids, params, use_cache=use_cache, cache_salt=cache_salt)
        except PromptError as e:
            raise APIError(422, str(e).replace("max_new_tokens", max_tokens_field), "validation",
                           reason="context_length") from e
        except QueueFullError as e:
            raise APIError(429, str(e), "overloaded", headers={"Retry-After": "1"}, reason="queue_full") from e
        except EngineStoppedError as e:
            raise APIError(503, str(e), "unavailable", headers={"Retry-After": "5"}, reason="shutting_down") from e

    async def events(self, request: Request) -> AsyncIterator[TokenOutput]:
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(request))
        deadline = asyncio.get_running_loop().call_later(self.timeout, self._expire) if self.timeout else None
        previous = None
        try:
            async for out in self.stream:
                if out.token_id is not None:
                    self.metrics.on_token(out, previous, self.use_cache)
                if out.finished:
                    if self.expired and out.finish_reason == FINISH_ABORT:  # counted as an error, not an abort
                        out = replace(out, finish_reason=FINISH_ERROR, error_type="timeout", error=(
                            f"the request ran past its deadline of {self.timeout:g} s "
                            "(parameters.timeout / --request-timeout)"))
                    self.metrics.on_finish(out.finish_reason, len(self.prompt_ids), out.stats, self.use_cache)
                previous = out
                yield out
        finally:
            watcher.cancel()
            if deadline is not None:
                deadline.cancel()
            if not self.stream.done:  # the consumer left early: the client is gone
                self.stream.cancel()
                self.metrics.on_finish(FINISH_ABORT, len(self.prompt_ids), None, self.use_cache)

    async def collect(self, request: Request) -> list[TokenOutput]:
        outs = [out async for out in self.events(request)]
        final = outs[-1]
        if final.finish_reason == FINISH_ERROR:
            error_type = final.error_type or "generation"
            raise APIError(ERROR_STATUS.get(error_type, 500), final.error or "generation failed", error_type)
        if final.finish_reason == FINISH_ABORT:
            raise APIError(503, "the request was cancelled", "cancelled")
        return outs

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.stream.cancel()

    def _expire(self) -> None:
        if not self.stream.done:
            self.expired = True
            self.metrics.on_rejected("timeout")
            self.stream.cancel()


def error_event(out: TokenOutput) -> str:
    return sse(ErrorResponse(error=out.error or "generation failed", error_type=out.error_type or "generation"))


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_response(events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    """`gen` is cancelled once the response is over, also when the client left before its first event
    (then `events` never started, so its own cleanup never runs)."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(gen.stream.cancel))


async def _guarded(events: AsyncIterator[str], error_type: str = "generation") -> AsyncIterator[str]:
    """A failure inside a stream becomes its last event instead of a torn connection."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - anything here must reach the client as an error event
        log.exception("stream failed")
        yield sse(ErrorResponse(error=f"{type(e).__name__}: {e}", error_type=error_type))


# ---- TGI ----------------------------------------------------------------------------------------


def _token(out: TokenOutput) -> Token:
    return Token(id=out.token_id, text=out.text, logprob=out.logprob, special=out.special)


def _timing(final: TokenOutput) -> dict:
    s = final.stats
    return dict(use_cache=s.use_cache, cached_tokens=s.cached_tokens, queue_time_s=s.queue_time_s, time_to_first_token_s=s.time_to_first_token_s,
                e2e_latency_s=s.e2e_latency_s, tokens_per_s=s.tokens_per_s)


async def encode(engine: Engine, text: str) -> list[int]:
    if len(text) > LONG_TEXT:
        return await asyncio.to_thread(engine.tokenizer.encode, text)
    return engine.tokenizer.encode(text)


async def _tgi_prompt(engine: Engine, body: GenerateRequest) -> list[int]:
    ids = await encode(engine, body.inputs)
    return ids[-body.parameters.truncate:] if body.parameters.truncate else ids


async def tgi_generate(request: Request, body: GenerateRequest, engine: Engine, metrics: Metrics, limits: Limits,
                       *, stream: bool, as_list: bool = False):
    """TGI's /generate (`as_list` for the `/` route, which answers a one-element list)."""
    p = body.parameters
    limits.check_stop(p.stop, "parameters.stop")
    prompt_ids = await _tgi_prompt(engine, body)
    limits.check_prompt(len(prompt_ids))
    gen = Generation(engine, metrics, prompt_ids, tgi_sampling_params(p, len(prompt_ids), engine, limits),
                     p.use_cache, timeout=limits.deadline(p.timeout), cache_salt=p.cache_salt)
    prefix = body.inputs if p.return_full_text else ""
    attention = (lambda ids: attention_of_generation(engine, prompt_ids, ids)) if p.return_attention else None
    if stream:
        return sse_response(_guarded(_tgi_events(gen.events(request), prefix, len(prompt_ids), attention)), gen)
    outs = await gen.collect(request)
    final = outs[-1]
    text = prefix + "".join(o.text for o in outs)
    with_details = p.details or p.return_attention
    details = Details(finish_reason=TGI_FINISH[final.finish_reason], generated_tokens=len(outs),
                      seed=final.stats.seed, input_length=len(prompt_ids), tokens=[_token(o) for o in outs],
                      attention=await attention([o.token_id for o in outs]) if attention else None,
                      **_timing(final)) if with_details else None
    answer = GenerateResponse(generated_text=text, details=details)
    if attention is None:
        body_json = answer.model_dump(exclude_none=not with_details)
        return JSONResponse([body_json] if as_list else body_json)
    encoded = await asyncio.to_thread(answer.model_dump_json)  # a large payload: encoded off the event loop
    return Response(f"[{encoded}]" if as_list else encoded, media_type="application/json")


def tgi_token_event(out: TokenOutput) -> str:
    """The SSE event of a token that is not the last, as StreamResponse(...) serializes it, spelled out:
    several times cheaper per streamed token than building and dumping the model."""
    text = json.dumps(out.text, ensure_ascii=False)
    special = "true" if out.special else "false"
    return (f'data: {{"index":{out.index},"token":{{"id":{out.token_id},"text":{text},"logprob":'
            f'{json.dumps(out.logprob)},"special":{special}}},"generated_text":null,"details":null}}\n\n')


async def _tgi_events(events: AsyncIterator[TokenOutput], prefix: str, input_length: int,
                      attention: Callable[[list[int]], Awaitable[AttentionWeights]] | None = None
                      ) -> AsyncIterator[str]:
    texts: list[str] = []
    output_ids: list[int] = []
    async for out in events:
        if out.token_id is None:  # error or abort: no token to send
            if out.finish_reason == FINISH_ERROR:
                yield error_event(out)
            return
        texts.append(out.text)
        output_ids.append(out.token_id)
        if not out.finished:
            yield tgi_token_event(out)
            continue
        event = StreamResponse(index=out.index, token=_token(out))
        if out.finished:
            event.generated_text = prefix + "".join(texts)
            event.details = StreamDetails(finish_reason=TGI_FINISH[out.finish_reason], generated_tokens=out.index,
                                          seed=out.stats.seed, input_length=input_length,
                                          attention=await attention(output_ids) if attention else None,
                                          **_timing(out))
            if attention is not None:  # a large payload: encoded off the event loop
                yield await asyncio.to_thread(sse, event)
                continue
        yield sse(event)


# ---- OpenAI completions -------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, stats) -> Usage:
    cached = PromptTokensDetails(cached_tokens=stats.cached_tokens) if stats is not None else None
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=cached)


def _logprobs(outs: list[TokenOutput], offset: int) -> CompletionLogprobs:
    offsets, at = [], offset
    for o in outs:
        offsets.append(at)
        at += len(o.text)
    return CompletionLogprobs(tokens=[o.text for o in outs], token_logprobs=[o.logprob for o in outs],
                              text_offset=offsets)


async def openai_completion(request: Request, body: CompletionRequest, engine: Engine, metrics: Metrics,
                            limits: Limits, model_name: str):
    if body.model != model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "not_found")
    limits.check_stop(body.stop_list, "stop")
    prompt_ids = await encode(engine, body.prompt_text)
    limits.check_prompt(len(prompt_ids))
    gen = Generation(engine, metrics, prompt_ids, openai_sampling_params(body, engine, limits), body.use_cache,
                     timeout=limits.deadline(body.timeout), max_tokens_field="max_tokens", cache_salt=body.cache_salt)
    head = CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name, choices=[])
    echo = body.prompt_text if body.echo else ""
    if body.stream:
        return sse_response(_guarded(_openai_events(gen.events(request), head, body, echo, len(prompt_ids))), gen)
    outs = await gen.collect(request)
    final = outs[-1]
    choice = CompletionChoice(text=echo + "".join(o.text for o in outs), finish_reason=OPENAI_FINISH[final.finish_reason],
                              logprobs=_logprobs(outs, len(echo)) if body.logprobs is not None else None)
    usage = _usage(len(prompt_ids), len(outs), final.stats)
    return JSONResponse(head.model_copy(update={"choices": [choice], "usage": usage}).model_dump(mode="json"))


class ChunkEncoder:
    """A stream's text_completion chunks, as CompletionResponse(...) serializes them, from a prefix
    dumped once: several times cheaper per streamed token than building and dumping the model."""

    def __init__(self, head: CompletionResponse) -> None:
        self._prefix = "data: " + head.model_dump_json(exclude={"usage", "choices"})[:-1] + ',"choices":['

    def __call__(self, choice: CompletionChoice) -> str:
        logprobs = "null" if choice.logprobs is None else choice.logprobs.model_dump_json()
        return (f'{self._prefix}{{"index":{choice.index},"text":{json.dumps(choice.text, ensure_ascii=False)},'
                f'"logprobs":{logprobs},"finish_reason":{json.dumps(choice.finish_reason)}}}]}}\n\n')


async def _openai_events(events: AsyncIterator[TokenOutput], head: CompletionResponse, body: CompletionRequest,
                         echo: str, prompt_tokens: int) -> AsyncIterator[str]:
    chunk = ChunkEncoder(head)

    if echo:
        yield chunk(CompletionChoice(text=echo))
    offset, generated, final_stats = len(echo), 0, None
    async for out in events:
        if out.token_id is None:
            if out.finish_reason == FINISH_ERROR:
                yield error_event(out)
                yield "data: [DONE]\n\n"
            return
        generated += 1
        final_stats = out.stats or final_stats
        if out.text or out.finished:
            logprobs = _logprobs([out], offset) if body.logprobs is not None else None
            yield chunk(CompletionChoice(text=out.text, logprobs=logprobs,
                                         finish_reason=OPENAI_FINISH.get(out.finish_reason)))
            offset += len(out.text)
    if (body.stream_options or {}).get("include_usage"):
        usage = _usage(prompt_tokens, generated, final_stats)
        yield sse(head.model_copy(update={"choices": [], "usage": usage}).model_dump_json())
    yield "data: [DONE]\n\n"
