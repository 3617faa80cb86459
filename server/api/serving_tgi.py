"""TGI's routes (`/generate`, `/generate_stream`, `/`): parameters to engine requests, answers and events
in TGI's shapes, with details (prefill logprobs, top tokens, best_of sequences) when asked for."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from model.grammar import GrammarSpec
from model.sampling import SamplingParams
from server.api.attention_view import attention_of_generation
from server.api.encoding import encode
from server.api.engine_client import EngineClient
from server.api.errors import APIError
from server.api.generation import Generation, tokens_of
from server.api.limits import TGI_DEFAULT_MAX_NEW_TOKENS, Limits
from server.api.metrics import Metrics
from server.api.params import sampling_params
from server.api.protocol import (
    AttentionWeights,
    BestOfSequence,
    Details,
    GenerateParameters,
    GenerateRequest,
    GenerateResponse,
    PrefillToken,
    StreamDetails,
    StreamResponse,
    Token,
)
from server.api.seeds import copies_of, seed_for
from server.api.sse import error_event, sse, sse_response
from server.api.structured import checked, tgi_grammar
from server.engine import FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, TokenOutput

TGI_FINISH = {FINISH_LENGTH: "length", FINISH_EOS: "eos_token", FINISH_STOP: "stop_sequence"}


def tgi_sampling_params(
    p: GenerateParameters, prompt_len: int, engine: EngineClient, limits: Limits, grammar: GrammarSpec | None = None
) -> SamplingParams:
    """TGI's rule: sampling happens when do_sample is true, or when temperature (!= 1), top_k or
    top_p (< 1) is given; otherwise decoding is greedy and those fields are ignored. A missing
    max_new_tokens is TGI's 100, cut as Limits.new_tokens says. `grammar`: parameters.grammar, checked."""
    sampling = p.do_sample or p.temperature not in (None, 1.0) or p.top_k is not None or p.top_p not in (None, 1.0)
    max_new = limits.new_tokens(
        p.max_new_tokens,
        "parameters.max_new_tokens",
        prompt_len=prompt_len,
        context_length=engine.context_length,
        default=TGI_DEFAULT_MAX_NEW_TOKENS,
    )
    limits.check_count("parameters.top_n_tokens", p.top_n_tokens, "max_logprobs")
    limits.check_count("parameters.best_of", p.best_of, "max_best_of")
    if (p.best_of or 1) > 1 and not sampling:
        raise APIError(
            422,
            "parameters.best_of > 1 needs sampling (do_sample, temperature, top_k or top_p), as in TGI",
            "validation",
        )
    return sampling_params(
        engine.model_config.vocab_size,
        max_new_tokens=max_new,
        temperature=(p.temperature or 1.0) if sampling else 0.0,
        top_k=(p.top_k or 0) if sampling else 0,
        top_p=(p.top_p or 1.0) if sampling else 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=seed_for(sampling, p.seed),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.top_n_tokens or 0,
        prompt_logprobs=0 if p.decoder_input_details else None,
        grammar=grammar,
    )


def _token(engine: EngineClient, out: TokenOutput) -> Token:
    return Token(id=out.token_id, text=out.text, logprob=out.logprob, special=out.special)


def _top_tokens(engine: EngineClient, out: TokenOutput) -> list[Token] | None:
    if out.top_logprobs is None:
        return None
    special = engine.tokenizer.special_ids
    return [
        Token(id=t, text=engine.tokenizer.decode([t]), logprob=lp, special=t in special) for t, lp in out.top_logprobs
    ]


def _prefill(engine: EngineClient, prompt_ids: list[int], first: TokenOutput) -> list[PrefillToken]:
    """details.prefill: each prompt token with its logprob (None for the first)."""
    if first.prompt_logprobs is None:
        return []
    logprobs = {e.position: e.logprob for e in first.prompt_logprobs}
    return [
        PrefillToken(id=t, text=engine.tokenizer.decode([t]), logprob=logprobs.get(i)) for i, t in enumerate(prompt_ids)
    ]


def _timing(final: TokenOutput) -> dict:
    s = final.stats
    return dict(
        use_cache=s.use_cache,
        cached_tokens=s.cached_tokens,
        draft_tokens=s.draft_tokens,
        accepted_draft_tokens=s.accepted_draft_tokens,
        queue_time_s=s.queue_time_s,
        time_to_first_token_s=s.time_to_first_token_s,
        e2e_latency_s=s.e2e_latency_s,
        tokens_per_s=s.tokens_per_s,
    )


def _sequence_logprob(outs: list[TokenOutput]) -> float:
    return sum(o.logprob for o in tokens_of(outs))


async def tgi_generate(
    request: Request,
    body: GenerateRequest,
    engine: EngineClient,
    metrics: Metrics,
    limits: Limits,
    *,
    stream: bool,
    as_list: bool = False,
):
    """TGI's /generate (`as_list` for the `/` route, which answers a one-element list)."""
    p = body.parameters
    limits.check_stop(p.stop, "parameters.stop")
    ids = await encode(engine, body.inputs, add_special_tokens=True)
    prompt_ids = ids[-p.truncate :] if p.truncate else ids
    limits.check_prompt(len(prompt_ids))
    grammar = await checked(engine, tgi_grammar(p.grammar))
    params = tgi_sampling_params(p, len(prompt_ids), engine, limits, grammar)
    best_of = p.best_of or 1
    if p.return_attention and not engine.info.in_process:
        raise APIError(
            422,
            "parameters.return_attention needs the model in this process (python -m server), "
            "not behind the cluster's ingress",
            "validation",
        )
    if stream and best_of > 1:
        raise APIError(422, "parameters.best_of > 1 cannot be streamed, as in TGI", "validation")
    if stream and p.decoder_input_details:
        raise APIError(422, "parameters.decoder_input_details cannot be streamed, as in TGI", "validation")
    gen = Generation(
        engine,
        metrics,
        [prompt_ids],
        copies_of(params, best_of),
        p.use_cache,
        timeout=limits.deadline(p.timeout),
        cache_salt=p.cache_salt,
        speculative=p.speculative,
    )
    await gen.admitted()
    prefix = body.inputs if p.return_full_text else ""
    attention = (lambda out_ids: attention_of_generation(engine, prompt_ids, out_ids)) if p.return_attention else None
    if stream:
        return sse_response(
            _tgi_events(engine, gen.events(request), prefix, prompt_ids, attention),
            gen.cancel,
            more_ready=None if attention else gen.has_ready,
        )  # the attention is computed off the loop
    choices = await gen.collect(request)
    best = max(range(best_of), key=lambda k: _sequence_logprob(choices[k]))  # the likeliest, as TGI picks
    outs, final = tokens_of(choices[best]), choices[best][-1]
    text = prefix + "".join(o.text for o in outs)
    with_details = p.details or p.return_attention or p.decoder_input_details or best_of > 1
    details = None
    if with_details:
        top = [_top_tokens(engine, o) for o in outs] if p.top_n_tokens else None
        others = (
            [
                BestOfSequence(
                    generated_text=prefix + "".join(o.text for o in tokens_of(choices[k])),
                    finish_reason=TGI_FINISH[choices[k][-1].finish_reason],
                    generated_tokens=len(tokens_of(choices[k])),
                    seed=choices[k][-1].stats.seed,
                    prefill=_prefill(engine, prompt_ids, choices[k][0]),
                    tokens=[_token(engine, o) for o in tokens_of(choices[k])],
                    top_tokens=[_top_tokens(engine, o) for o in tokens_of(choices[k])] if p.top_n_tokens else None,
                )
                for k in range(best_of)
                if k != best
            ]
            if best_of > 1
            else None
        )
        details = Details(
            finish_reason=TGI_FINISH[final.finish_reason],
            generated_tokens=len(outs),
            seed=final.stats.seed,
            input_length=len(prompt_ids),
            prefill=_prefill(engine, prompt_ids, choices[best][0]),
            tokens=[_token(engine, o) for o in outs],
            top_tokens=top,
            best_of_sequences=others,
            attention=await attention([o.token_id for o in outs]) if attention else None,
            **_timing(final),
        )
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
    return (
        f'data: {{"index":{out.index},"token":{{"id":{out.token_id},"text":{text},"logprob":'
        f'{json.dumps(out.logprob)},"special":{special}}},"generated_text":null,"details":null}}\n\n'
    )


async def _tgi_events(
    engine: EngineClient,
    events: AsyncIterator[tuple[int, TokenOutput]],
    prefix: str,
    prompt_ids: list[int],
    attention: Callable[[list[int]], Awaitable[AttentionWeights]] | None,
) -> AsyncIterator[str]:
    texts: list[str] = []
    output_ids: list[int] = []
    async for _, out in events:
        if out.token_id is None:  # error or abort: no token to send
            if out.finish_reason == FINISH_ERROR:
                yield error_event(out)
            return
        texts.append(out.text)
        output_ids.append(out.token_id)
        top = _top_tokens(engine, out)
        if not out.finished and top is None:
            yield tgi_token_event(out)
            continue
        event = StreamResponse(index=out.index, token=_token(engine, out), top_tokens=top)
        if out.finished:
            event.generated_text = prefix + "".join(texts)
            event.details = StreamDetails(
                finish_reason=TGI_FINISH[out.finish_reason],
                generated_tokens=out.index,
                seed=out.stats.seed,
                input_length=len(prompt_ids),
                attention=await attention(output_ids) if attention else None,
                **_timing(out),
            )
            if attention is not None:  # a large payload: encoded off the event loop
                yield await asyncio.to_thread(sse, event)
                continue
        yield sse(event)
