"""OpenAI's `/v1/chat/completions`, for a checkpoint whose tokenizer_config.json carries a chat template:
the messages rendered through it, then generated as a completion; answered whole or streamed as
chat.completion.chunk events. Without a template the route answers 400 and says so, as vLLM does."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from model.grammar import GrammarSpec
from model.sampling import SamplingParams
from server.api.chat_template import ChatTemplateError, ContentError, render, text_content
from server.api.encoding import encode
from server.api.engine_client import EngineClient
from server.api.errors import APIError
from server.api.generation import Generation, tokens_of
from server.api.limits import Limits
from server.api.metrics import Metrics
from server.api.model_names import ServedNames
from server.api.openai_output import OPENAI_FINISH, usage_of, usage_so_far
from server.api.params import logit_bias_of, sampling_params
from server.api.protocol_openai import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaFunction,
    DeltaToolCall,
    ToolCall,
    ToolCallFunction,
)
from server.api.seeds import copies_of, seed_for
from server.api.sse import DONE, NOTHING_YET, error_event, sse, sse_response
from server.api.structured import check_grammar, checked, openai_grammar
from server.api.tool_calls import (
    CallDelta,
    ToolCallParser,
    parameters_spec,
    parse_tool_calls,
    template_tool_calls,
    template_tools,
    tool_grammar,
)
from server.engine import FINISH_ERROR, TokenOutput


def chat_prompt(
    engine: EngineClient,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    model_name: str,
    tools: list[dict] | None = None,
) -> str:
    """The messages rendered through the checkpoint's chat template (a 400 without one, as vLLM), with the
    tokenizer's bos_token and eos_token texts and the tools as transformers passes them."""
    tokenizer = engine.tokenizer
    template = tokenizer.chat_template
    if template is None:
        raise APIError(
            400,
            f"the model {model_name!r} has no chat template (chat_template in its "
            "tokenizer_config.json), so /v1/chat/completions cannot format messages for it; "
            "send the text to /v1/completions instead",
            "invalid_request",
        )
    try:
        rendered = []
        for message in messages:
            fields = message.model_dump(exclude_none=True)
            if "content" in fields:
                fields["content"] = text_content(fields["content"])
            if message.tool_calls is not None:
                fields["tool_calls"] = template_tool_calls(message.tool_calls)
            rendered.append(fields)
        return render(
            template,
            rendered,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            tools=tools,
        )
    except (ChatTemplateError, ContentError) as e:
        raise APIError(400, str(e), "invalid_request") from e


async def chat_grammar(engine: EngineClient, body: ChatCompletionRequest) -> GrammarSpec | None:
    """The structured output a chat request asks for, checked: response_format and its kin, or the call that
    tool_choice forces (each function's parameters checked on their own first, so a refusal names the tool)."""
    asked = openai_grammar(body)
    choice = body.effective_tool_choice
    forced = tool_grammar(body.tools or [], choice, body.parallel_tool_calls)
    if forced is None:
        return await checked(engine, asked)
    if asked is not None:
        raise APIError(
            422,
            f"{asked[1]} and a forced tool call (tool_choice) cannot both constrain the output",
            "validation",
            reason="grammar",
        )
    for i, tool in enumerate(body.tools):
        await check_grammar(engine, parameters_spec(tool), f"tools[{i}].function.parameters")
    return await check_grammar(engine, forced, "tools")


def chat_params(
    body: ChatCompletionRequest,
    engine: EngineClient,
    limits: Limits,
    prompt_len: int,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    max_new = limits.new_tokens(  # no default of chat's own: what the context leaves
        body.max_new_tokens, "max_tokens", prompt_len=prompt_len, context_length=engine.context_length, default=None
    )
    limits.check_count("n", body.n, "max_n")
    limits.check_count("top_logprobs", body.top_logprobs, "max_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else 0
    return sampling_params(
        engine.model_config.vocab_size,
        max_new_tokens=max_new,
        temperature=temperature,
        top_k=body.top_k or 0,
        top_p=body.top_p or 1.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias_of(body.logit_bias, engine.model_config.vocab_size),
        seed=seed_for(temperature > 0, body.seed),
        stop=tuple(body.stop_list),
        ignore_eos=body.ignore_eos,
        logprobs=top,
        grammar=grammar,
    )


def _logprobs(engine: EngineClient, outs: list[TokenOutput], top: int) -> ChatChoiceLogprobs:
    def entry(token_id: int, text: str, logprob: float) -> dict:
        return dict(token=text, logprob=logprob, bytes=list(engine.tokenizer.token_bytes(token_id)))

    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(  # each token by its own text, as its bytes are
                **entry(o.token_id, engine.tokenizer.decode([o.token_id]), o.logprob),
                top_logprobs=[
                    ChatLogprob(**entry(t, engine.tokenizer.decode([t]), lp)) for t, lp in (o.top_logprobs or [])
                ]
                if top
                else [],
            )
            for o in outs
        ]
    )


async def chat_completion(
    request: Request,
    body: ChatCompletionRequest,
    engine: EngineClient,
    metrics: Metrics,
    limits: Limits,
    names: ServedNames,
):
    names.check(body.model)
    limits.check_stop(body.stop_list, "stop")
    tools = template_tools(body.tools)
    text = chat_prompt(engine, body.messages, body.add_generation_prompt, names.primary, tools)
    prompt_ids = await encode(engine, text, add_special_tokens=False)  # the template wrote them
    limits.check_prompt(len(prompt_ids))
    params = chat_params(body, engine, limits, len(prompt_ids), await chat_grammar(engine, body))
    gen = Generation(
        engine,
        metrics,
        [prompt_ids],
        copies_of(params, body.n),
        body.use_cache,
        timeout=limits.deadline(body.timeout),
        max_tokens_field="max_tokens",
        cache_salt=body.cache_salt,
        speculative=body.speculative,
    )
    await gen.admitted()
    head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=names.primary)
    if body.stream:
        return sse_response(
            _chat_events(engine, gen.events(request), head, body, prompt_ids),
            gen.cancel,
            openai=True,
            more_ready=gen.has_ready,
        )
    outs = await gen.collect(request)
    choices = []
    for k, events in enumerate(outs):
        text, calls = "".join(o.text for o in tokens_of(events)), None
        finish = OPENAI_FINISH[events[-1].finish_reason]
        if _parses_calls(body):
            text, parsed = parse_tool_calls(text, None if body.parallel_tool_calls else 1)
            calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in parsed]
            finish = "tool_calls" if calls and finish == "stop" else finish
        choices.append(
            ChatChoice(
                index=k,
                message=ChatResponseMessage(content=text, tool_calls=calls or None),
                logprobs=_logprobs(engine, tokens_of(events), params.logprobs) if body.logprobs else None,
                finish_reason=finish,
            )
        )
    answer = ChatCompletionResponse(**head, choices=choices, usage=usage_of([prompt_ids], outs, body.n))
    return JSONResponse(answer.model_dump(mode="json"))


async def _chat_events(
    engine: EngineClient,
    events: AsyncIterator[tuple[int, TokenOutput]],
    head: dict,
    body: ChatCompletionRequest,
    prompt_ids: list[int],
) -> AsyncIterator[str]:
    generated = [0] * body.n

    def chunk(**choice) -> str:  # with continuous_usage_stats, the choice's usage so far
        usage = usage_so_far(len(prompt_ids), generated[choice["index"]]) if body.continuous_usage else None
        return sse(
            ChatCompletionChunk(**head, choices=[ChatChunkChoice(**choice)], usage=usage).model_dump_json(
                exclude=None if usage else {"usage"}
            )
        )

    started = [False] * body.n
    choices: list[list[TokenOutput]] = [[] for _ in range(body.n)]
    held: list[list[TokenOutput]] = [[] for _ in range(body.n)]  # tokens whose text is held back, per choice
    max_calls = None if body.parallel_tool_calls else 1
    parsers = [ToolCallParser(max_calls) for _ in range(body.n)] if _parses_calls(body) else None
    async for k, out in events:
        choices[k].append(out)
        generated[k] += out.token_id is not None
        if out.token_id is None:
            if out.finish_reason == FINISH_ERROR:
                yield error_event(out, openai=True)
                yield DONE
                return
            yield NOTHING_YET
            continue
        if not started[k]:  # OpenAI's first delta of a choice names the role
            started[k] = True
            yield chunk(index=k, delta=ChatDelta(role="assistant", content=""))
        held[k].append(out)
        content, calls, finish = out.text, None, OPENAI_FINISH.get(out.finish_reason)
        if parsers is not None:  # the text as content and tool-call pieces, each call's name first
            parser = parsers[k]
            content, deltas = parser.push(out.text)
            if out.finished:
                rest, more = parser.finish()
                content, deltas = content + rest, deltas + more
                finish = "tool_calls" if parser.result() and finish == "stop" else finish
            calls = [_delta_call(d) for d in deltas] or None
        if content or calls or out.finished:  # the chunk carries the logprobs of every token since the last one
            logprobs = _logprobs(engine, held[k], body.top_logprobs or 0) if body.logprobs else None
            if calls and content:  # content first, then the calls, as separate deltas
                yield chunk(index=k, delta=ChatDelta(content=content))
                content = None
            yield chunk(
                index=k,
                delta=ChatDelta(content=content if content or not calls else None, tool_calls=calls),
                logprobs=logprobs,
                finish_reason=finish,
            )
            held[k] = []
        else:
            yield NOTHING_YET
    if any(c and c[-1].finish_reason not in OPENAI_FINISH for c in choices):
        return  # cancelled
    if body.include_usage:
        usage = usage_of([prompt_ids], choices, body.n)
        yield sse(ChatCompletionChunk(**head, choices=[], usage=usage))
    yield DONE


def _parses_calls(body: ChatCompletionRequest) -> bool:
    """Whether the answer is read for tool calls: with tools, unless tool_choice is none."""
    return bool(body.tools) and body.effective_tool_choice != "none"


def _delta_call(d: CallDelta) -> DeltaToolCall:
    first = d.id is not None
    return DeltaToolCall(
        index=d.index,
        id=d.id,
        type="function" if first else None,
        function=DeltaFunction(name=d.name, arguments=d.arguments),
    )
