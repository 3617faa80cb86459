"""OpenAI's `/v1/completions`: one or more prompts (text or token ids), n choices each (or the n likeliest
of best_of), logprobs with top alternatives, echo with the prompt's own logprobs, scoring a prompt with
max_tokens 0, penalties and logit bias; streamed as text_completion chunks or answered whole."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from model.grammar import GrammarSpec
from model.sampling import SamplingParams
from server.api.encoding import encode
from server.api.engine_client import EngineClient
from server.api.generation import Generation, tokens_of
from server.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS, Limits
from server.api.metrics import Metrics
from server.api.model_names import ServedNames
from server.api.openai_output import OPENAI_FINISH, usage_of, usage_so_far
from server.api.params import logit_bias_of, sampling_params
from server.api.protocol_openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from server.api.seeds import copies_of, seed_for
from server.api.sse import DONE, NOTHING_YET, error_event, sse_response
from server.api.structured import checked, openai_grammar
from server.engine import FINISH_ERROR, TokenOutput


def completion_params(
    r: CompletionRequest, engine: EngineClient, limits: Limits, prompt_len: int, grammar: GrammarSpec | None = None
) -> SamplingParams:
    """OpenAI's rule: temperature defaults to 1 (sampling); temperature 0 is greedy. A missing max_tokens is
    OpenAI's 16, cut as Limits.new_tokens says (`prompt_len`: the longest prompt's). `grammar`: the structured
    output asked for, checked (server/api/structured.py)."""
    temperature = 1.0 if r.temperature is None else r.temperature
    max_tokens = limits.new_tokens(
        r.max_tokens,
        "max_tokens",
        prompt_len=prompt_len,
        context_length=engine.context_length,
        default=COMPLETIONS_DEFAULT_MAX_TOKENS,
    )
    limits.check_count("n", r.n, "max_n")
    limits.check_count("best_of", r.best_of, "max_best_of")
    limits.check_count("logprobs", r.logprobs, "max_logprobs")
    return sampling_params(
        engine.model_config.vocab_size,
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_k=r.top_k or 0,
        top_p=r.top_p or 1.0,
        repetition_penalty=r.repetition_penalty or 1.0,
        presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty,
        logit_bias=logit_bias_of(r.logit_bias, engine.model_config.vocab_size),
        seed=seed_for(temperature > 0, r.seed),
        stop=tuple(r.stop_list),
        ignore_eos=r.ignore_eos,
        logprobs=r.logprobs or 0,
        prompt_logprobs=r.logprobs if r.echo and r.logprobs is not None else (0 if r.max_tokens == 0 else None),
        grammar=grammar,
    )


async def prompt_ids_of(engine: EngineClient, prompts: list[str | list[int]], limits: Limits) -> list[list[int]]:
    limits.check_count("prompt (a list of prompts)", len(prompts), "max_prompts")
    out = []
    for p in prompts:
        ids = await encode(engine, p, add_special_tokens=True) if isinstance(p, str) else p
        limits.check_prompt(len(ids))
        out.append(ids)
    return out


class LogprobsBuilder:
    """A choice's `logprobs`: each token's text, logprob, top alternatives and offset into the text.
    `top` is the request's `logprobs`: None gives no top_logprobs; 0 gives each token's own entry only,
    as vLLM does; k gives the k likeliest and the chosen token."""

    def __init__(self, engine: EngineClient, top: int | None) -> None:
        self.decode, self.top = engine.tokenizer.decode, top

    def prompt(self, prompt_ids: list[int], first: TokenOutput | None) -> CompletionLogprobs:
        """The echoed prompt: its first token has no logprob (nothing comes before it)."""
        scored = {e.position: e for e in (first.prompt_logprobs or [])} if first is not None else {}
        tokens = [self.decode([t]) for t in prompt_ids]
        logprobs = [scored[i].logprob if i in scored else None for i in range(len(prompt_ids))]
        top = [
            self._top(scored[i].top, prompt_ids[i], scored[i].logprob) if i in scored else None
            for i in range(len(prompt_ids))
        ]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=logprobs,
            top_logprobs=None if self.top is None else top,
            text_offset=_offsets(tokens, 0),
        )

    def generated(self, outs: list[TokenOutput], offset: int) -> CompletionLogprobs:
        """Generated tokens, each by its own text (as vLLM gives it: not the text it released, which is
        empty while a stop string or a split character holds it back, and several tokens' at once after)."""
        tokens = [self.decode([o.token_id]) for o in outs]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[o.logprob for o in outs],
            top_logprobs=None if self.top is None else [self._top(o.top_logprobs, o.token_id, o.logprob) for o in outs],
            text_offset=_offsets(tokens, offset),
        )

    def _top(self, pairs, chosen: int, chosen_logprob: float) -> dict[str, float]:
        """The likeliest alternatives and, as OpenAI gives it, the chosen token too when it is not among
        them: up to `logprobs` + 1 entries (with logprobs 0, the chosen token's alone)."""
        out: dict[str, float] = {}
        for token, logprob in [*(pairs or ()), (chosen, chosen_logprob)]:
            out.setdefault(self.decode([token]), logprob)  # two ids may decode alike: the likelier stays
        return out


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return offsets


def _join(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=(a.top_logprobs or []) + (b.top_logprobs or [])
        if a.top_logprobs is not None or b.top_logprobs is not None
        else None,
        text_offset=a.text_offset + b.text_offset,
    )


async def openai_completion(
    request: Request,
    body: CompletionRequest,
    engine: EngineClient,
    metrics: Metrics,
    limits: Limits,
    names: ServedNames,
):
    names.check(body.model)
    limits.check_stop(body.stop_list, "stop")
    prompts = await prompt_ids_of(engine, body.prompts, limits)
    grammar = await checked(engine, openai_grammar(body))
    params = completion_params(body, engine, limits, max(map(len, prompts)), grammar)
    n, copies = body.n, body.best_of or body.n
    gen = Generation(
        engine,
        metrics,
        prompts,
        copies_of(params, copies),
        body.use_cache,
        timeout=limits.deadline(body.timeout),
        max_tokens_field="max_tokens",
        cache_salt=body.cache_salt,
        speculative=body.speculative,
    )
    await gen.admitted()
    head = CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=names.primary, choices=[])
    builder = LogprobsBuilder(engine, body.logprobs)
    texts = [engine.tokenizer.decode(p) if isinstance(raw, list) else raw for p, raw in zip(prompts, body.prompts)]
    if body.stream:
        events = _completion_events(gen.events(request), head, body, prompts, texts, builder, gen)
        return sse_response(events, gen.cancel, openai=True, more_ready=gen.has_ready)
    outs = await gen.collect(request)
    choices, returned = [], []
    for i, prompt in enumerate(prompts):
        group = outs[i * copies : (i + 1) * copies]
        if copies > n:  # best_of: the n likeliest, by the sum of their tokens' logprobs, in that order
            group = sorted(group, key=lambda c: -sum(o.logprob for o in tokens_of(c)))[:n]
        returned += group
        for j, events in enumerate(group):
            echo = texts[i] if body.echo else ""
            tokens = tokens_of(events)
            logprobs = None
            if body.logprobs is not None:
                prompt_part = builder.prompt(prompt, events[0]) if body.echo else None
                logprobs = _join(prompt_part, builder.generated(tokens, len(echo)))
            choices.append(
                CompletionChoice(
                    index=i * n + j,
                    text=echo + "".join(o.text for o in tokens),
                    logprobs=logprobs,
                    finish_reason=OPENAI_FINISH[events[-1].finish_reason],
                )
            )
    usage = usage_of(prompts, outs, copies, returned)
    return JSONResponse(head.model_copy(update={"choices": choices, "usage": usage}).model_dump(mode="json"))


class ChunkEncoder:
    """A stream's text_completion chunks, as CompletionResponse(...) serializes them, from a prefix
    dumped once: several times cheaper per streamed token than building and dumping the model."""

    def __init__(self, head: CompletionResponse) -> None:
        self._prefix = "data: " + head.model_dump_json(exclude={"usage", "choices"})[:-1] + ',"choices":['

    def __call__(self, choice: CompletionChoice, usage: Usage | None = None) -> str:
        logprobs = "null" if choice.logprobs is None else choice.logprobs.model_dump_json()
        usage_part = "" if usage is None else f',"usage":{usage.model_dump_json()}'
        return (
            f'{self._prefix}{{"index":{choice.index},"text":{json.dumps(choice.text, ensure_ascii=False)},'
            f'"logprobs":{logprobs},"finish_reason":{json.dumps(choice.finish_reason)}}}]{usage_part}}}\n\n'
        )


async def _completion_events(
    events: AsyncIterator[tuple[int, TokenOutput]],
    head: CompletionResponse,
    body: CompletionRequest,
    prompts: list[list[int]],
    texts: list[str],
    builder: LogprobsBuilder,
    gen: Generation,
) -> AsyncIterator[str]:
    encode_chunk, n = ChunkEncoder(head), body.n
    offsets = [len(texts[k // n]) if body.echo else 0 for k in range(len(prompts) * n)]
    echoed = [False] * len(offsets)
    choices: list[list[TokenOutput]] = [[] for _ in offsets]
    generated = [0] * len(offsets)
    held: list[list[TokenOutput]] = [[] for _ in offsets]  # tokens whose text is held back, per choice

    def chunk(choice: CompletionChoice) -> str:  # with continuous_usage_stats, the choice's usage so far
        k = choice.index
        return encode_chunk(choice, usage_so_far(len(prompts[k // n]), generated[k]) if body.continuous_usage else None)

    async for k, out in events:
        choices[k].append(out)
        generated[k] += out.token_id is not None
        if out.token_id is None and out.finish_reason == FINISH_ERROR:
            yield error_event(out, openai=True)
            yield DONE
            return
        if body.echo and not echoed[k]:
            echoed[k] = True
            logprobs = builder.prompt(prompts[k // n], out) if body.logprobs is not None else None
            yield chunk(CompletionChoice(index=k, text=texts[k // n], logprobs=logprobs))
        if out.token_id is None:
            if out.finish_reason in OPENAI_FINISH:  # a scored prompt: nothing generated
                yield chunk(CompletionChoice(index=k, text="", finish_reason=OPENAI_FINISH[out.finish_reason]))
            else:
                yield NOTHING_YET
            continue
        held[k].append(out)
        if out.text or out.finished:  # the chunk carries the logprobs of every token since the last one
            logprobs = builder.generated(held[k], offsets[k]) if body.logprobs is not None else None
            yield chunk(
                CompletionChoice(
                    index=k, text=out.text, logprobs=logprobs, finish_reason=OPENAI_FINISH.get(out.finish_reason)
                )
            )
            offsets[k] += len(out.text)
            held[k] = []
        else:
            yield NOTHING_YET
    if any(c and c[-1].finish_reason not in OPENAI_FINISH for c in choices):
        return  # cancelled
    if body.include_usage:
        usage = usage_of(prompts, choices, n)
        yield "data: " + head.model_copy(update={"choices": [], "usage": usage}).model_dump_json() + "\n\n"
    yield DONE
