"""Request and response schemas of OpenAI's completions and chat completions (`/v1/completions`,
`/v1/chat/completions`, `/v1/models`), with the extensions vLLM accepts and a few of ours.

Unknown fields are refused (422) rather than ignored; limits that depend on the server's flags (n,
best_of, logprobs) are checked by the serving code, which names the flag.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.api.protocol import CACHE_SALT_DOC, MIN_TIMEOUT_S, TIMEOUT_DOC, NonEmptyStr, Strict, _refuse_unsupported

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="a last chunk with the request's usage, before [DONE]")
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's: with include_usage, every chunk also carries "
        "the usage so far of its choice (its prompt and tokens generated so far)",
    )


# ---- structured output --------------------------------------------------------------------------

JsonSchema = dict[str, Any]  # a JSON schema, checked when it is compiled (server/api/structured.py)


class JsonSchemaFormat(Strict):
    name: NonEmptyStr = Field(max_length=64, description="the schema's name (OpenAI's; not used otherwise)")
    description: str | None = None
    json_schema: JsonSchema = Field(alias="schema", description="the JSON schema the output matches")
    strict: bool | None = Field(None, description="accepted; the output always matches the schema here")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: exactly one of its fields."""

    json_schema: JsonSchema | str | None = Field(
        None, alias="json", description="a JSON schema (an object, or its JSON text)"
    )
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = Field(None, description="one of these strings")
    grammar: NonEmptyStr | None = Field(None, description="an EBNF grammar (llama.cpp's GBNF form) or a Lark grammar")
    json_object: bool | None = Field(None, description="true: any JSON object")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        fields = {"json": self.json_schema, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        given = [name for name, value in fields.items() if value is not None] + ["json_object"] * bool(self.json_object)
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self


class SamplingFields(Strict):
    """What completions and chat completions share."""

    model: str | None = Field(None, description="optional: this server serves one model")
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0 means greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, description="choices per prompt (at most --max-n)")
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(None, description="at most --max-stop-sequences (4)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> added to its logit"
    )
    user: str | None = None
    # extensions (vLLM accepts the first two as well)
    top_k: int | None = Field(None, gt=0)
    repetition_penalty: float | None = Field(None, gt=0)
    use_cache: bool = True
    speculative: bool = True  # false opts out of speculative decoding (the output is the same either way)
    ignore_eos: bool = False
    timeout: float | None = Field(None, ge=MIN_TIMEOUT_S, description=TIMEOUT_DOC)
    cache_salt: NonEmptyStr | None = Field(None, description=CACHE_SALT_DOC)
    # structured output (server/api/structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; at most one of them
    response_format: ResponseFormat | None = Field(
        None, description="text; json_object: any JSON object; json_schema: JSON matching json_schema.schema"
    )
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: the output matches one of these")
    guided_json: JsonSchema | str | None = Field(None, description="vLLM's older name for structured_outputs.json")
    guided_regex: NonEmptyStr | None = Field(None, description="vLLM's older name for structured_outputs.regex")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = Field(
        None, description="vLLM's older name for structured_outputs.choice"
    )
    guided_grammar: NonEmptyStr | None = Field(None, description="vLLM's older name for structured_outputs.grammar")

    @property
    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's continuous_usage_stats, which takes effect with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @model_validator(mode="after")
    def _stream_options_need_usage(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true (as in OpenAI's API and vLLM)")
        if (
            self.stream_options is not None
            and self.stream_options.continuous_usage_stats
            and not self.stream_options.include_usage
        ):
            raise ValueError(
                "stream_options.continuous_usage_stats needs stream_options.include_usage: true "
                "(as in vLLM, where it is otherwise ignored)"
            )
        return self


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="default 16, or less where --max-new-tokens or the context left after the prompt is less; "
        "0 with echo scores the prompt and generates nothing",
    )
    echo: bool = False
    logprobs: int | None = Field(
        None,
        ge=0,
        description="the likeliest alternatives of each token (at most "
        "--max-logprobs); 0: each token's own logprob only",
    )
    best_of: int | None = Field(
        None,
        ge=1,
        description="generate this many per prompt and return the n likeliest (at most --max-best-of; not with stream)",
    )
    suffix: str | None = Field(None, json_schema_extra={"enum": [None, ""]})  # accepted at its neutral value only

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        _refuse_unsupported(self, {"suffix": (None, "")})
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed: the best choices are known only at the end")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (it scores the prompt and generates nothing)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None = None  # with logprobs > 0: token text -> logprob
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int  # generated tokens that came from accepted speculative drafts
    rejected_prediction_tokens: int  # draft tokens verified and rejected


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat completions ---------------------------------------------------------------------------


class ContentPart(BaseModel):
    """One part of a message's content, in OpenAI's list form. Only text parts are served; a part of
    another type (image_url, input_audio, file...) is answered 400, naming the type."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: NonEmptyStr = Field(description="'text'; other types are refused with a 400 that names them")
    text: str | None = Field(None, description="the text of a 'text' part")

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a content part of type 'text' needs a 'text' string")
        return self


class FunctionCall(Strict):
    name: NonEmptyStr
    arguments: str | dict[str, Any] = Field(description="the arguments as JSON text (OpenAI's form), or an object")


class MessageToolCall(Strict):
    """A call an assistant message made (passed to the chat template with its arguments as an object)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = Field(
        "", description="a string, or a list of parts of which only text parts are served (joined by newlines)"
    )
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class FunctionDefinition(Strict):
    name: NonEmptyStr = Field(max_length=64)
    description: str | None = None
    parameters: JsonSchema | None = Field(
        None, description="a JSON schema of the arguments (an object); none: the function takes no arguments"
    )
    strict: bool | None = Field(None, description="accepted; a forced call's arguments always match parameters")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: NonEmptyStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="default: what the context leaves")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, description="with logprobs: alternatives per token (at most --max-logprobs)"
    )
    add_generation_prompt: bool = True  # vLLM's: the template's cue for the assistant's turn
    tools: list[Tool] | None = Field(None, description="functions the model may call (given to the chat template)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: no call; auto (the default with tools): the model chooses; required: at least one "
        "call; a named function: one call of it. required and named calls are forced by a grammar",
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true (as in OpenAI's API and vLLM)")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is not among the tools "
                f"({', '.join(repr(n) for n in names)})"
            )
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto with tools, none without."""
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls only
    tool_calls: list[ToolCall] | None = None


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # a fragment of the arguments' JSON text


class DeltaToolCall(BaseModel):
    index: int  # which call of the choice (OpenAI's streams number them from 0)
    id: str | None = None  # in a call's first delta
    type: Literal["function"] | None = None  # in a call's first delta
    function: DeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- models ---------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
