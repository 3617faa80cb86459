"""Request and response schemas: Hugging Face TGI's (`/generate`, `/generate_stream`, `/`) and what the
other families share. Routes live in `server.api.routes`, the logic in `server.api.serving_*`.

Unknown fields are refused (422) rather than ignored. Fields TGI or OpenAI define that this server does
not implement are accepted only at their neutral value, so a client sending defaults works.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


def _whole_numbers(value: Any) -> Any:
    """JSON Schema counts 254.0 as an integer: whole floats become ints, which strict mode takes for an
    integer field (and for a number field, as the same value); 254.5 stays refused where an integer is due."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def _lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone UTF-16 surrogate (JSON's "\\ud800" unpaired), or None: Python decodes one into a
    string that no tokenizer or UTF-8 encoder takes."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _refuse_lone_surrogates(value: Any, path: tuple = ()) -> None:
    """Refuses every string of a request body, values and keys, that is not Unicode text, naming the field: one
    rule at the door for every route, so no surrogate reaches a tokenizer (a 500) or a response (unencodable)."""
    if isinstance(value, str):
        at = _lone_surrogate(value)
        if at is not None:
            raise PydanticCustomError(
                "text_not_unicode",
                "a string holds a lone UTF-16 surrogate ({char}) at character {at}, which is not Unicode text",
                {"field": ".".join(map(str, path)) or "body", "char": ascii(value[at]).strip("'"), "at": at},
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            _refuse_lone_surrogates(k, path)  # a key names the field it sits in
            _refuse_lone_surrogates(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_lone_surrogates(v, (*path, i))


NonEmptyStr = Annotated[str, Field(min_length=1)]
MIN_TIMEOUT_S = 1.0  # a shorter deadline than this is a mistake (5e-324 once gave a 504), not a request
TIMEOUT_DOC = (
    f"our extension: seconds before the request is cut short (a 504, or an error event of type timeout), "
    f"at least {MIN_TIMEOUT_S:g}, at most --request-timeout"
)
CACHE_SALT_DOC = (
    "vLLM's extension: prefix-cache hits only among requests with the same salt (isolates "
    "tenants, or measures the cache without prefix reuse)"
)


class Strict(BaseModel):
    """Request bodies: unknown fields refused, no coercion, so a value is taken only in the type the schema
    names ("stream": 0 is not a boolean, "n": "2" not an integer), and only Unicode text in any string."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integers_as_json_schema_counts_them(cls, data: Any) -> Any:
        _refuse_lone_surrogates(data)
        return _whole_numbers(data)


def _refuse_unsupported(model: BaseModel, neutral: dict[str, tuple]) -> None:
    for name, allowed in neutral.items():
        value = getattr(model, name)
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported by this server (use one of {list(allowed)})")


# ---- TGI ----------------------------------------------------------------------------------------

NEUTRAL = {"typical_p": (None, 1.0), "watermark": (False,), "adapter_id": (None,)}


class TGIGrammar(Strict):
    """TGI's grammar: the output held to a JSON schema or a regular expression."""

    type: Literal["json", "json_object", "regex"] = Field(
        description="json (TGI's alias json_object): `value` is a JSON schema; regex: `value` is a regular expression"
    )
    value: dict[str, Any] | str = Field(description="the JSON schema (an object, or its JSON text), or the regex")

    @model_validator(mode="after")
    def _value_fits_type(self) -> TGIGrammar:
        if self.type == "regex" and not isinstance(self.value, str):
            raise ValueError("a regex grammar's value is the regular expression, a string")
        return self


class GenerateParameters(Strict):
    max_new_tokens: int | None = Field(None, ge=1, description="default: min(100, what the context leaves)")
    temperature: float | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: list[NonEmptyStr] = Field(default_factory=list, description="at most --max-stop-sequences (4)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    truncate: int | None = Field(None, ge=1, description="keep only the last `truncate` prompt tokens")
    use_cache: bool = Field(True, description="our extension: false recomputes the whole sequence every step")
    speculative: bool = Field(
        True,
        description="our extension: false opts out of speculative decoding "
        "(when the server runs it; the output is the same either way)",
    )
    return_attention: bool = Field(
        False,
        description="our extension: attention weights of the first generated "
        "tokens in details.attention (turns details on)",
    )
    ignore_eos: bool = Field(False, description="our extension (vLLM's): generate max_new_tokens whatever comes")
    timeout: float | None = Field(None, ge=MIN_TIMEOUT_S, description=TIMEOUT_DOC)
    cache_salt: NonEmptyStr | None = Field(None, description=CACHE_SALT_DOC)
    best_of: int | None = Field(
        None, ge=1, description="sample this many and return the likeliest (needs sampling; at most --max-best-of)"
    )
    decoder_input_details: bool = Field(False, description="each prompt token's logprob in details.prefill")
    top_n_tokens: int | None = Field(
        None,
        ge=0,
        description="the likeliest alternatives of each generated token, "
        "in details.top_tokens (at most --max-logprobs)",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        description="minus this times the number of times a token was generated, from its logit (OpenAI's definition)",
    )
    grammar: TGIGrammar | None = Field(
        None, description="structured output: the generated text matches this JSON schema or regular expression"
    )
    # TGI fields accepted at their neutral value only (the schema lists it: enum)
    typical_p: float | None = Field(None, json_schema_extra={"enum": list(NEUTRAL["typical_p"])})
    watermark: bool = Field(False, json_schema_extra={"enum": list(NEUTRAL["watermark"])})
    adapter_id: str | None = Field(None, json_schema_extra={"enum": list(NEUTRAL["adapter_id"])})

    @model_validator(mode="after")
    def _neutral_only(self) -> GenerateParameters:
        _refuse_unsupported(self, NEUTRAL)
        return self


class GenerateRequest(Strict):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


class Token(BaseModel):
    id: int
    text: str
    logprob: float
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None  # None for the first: nothing comes before it


TGIFinishReason = Literal["length", "eos_token", "stop_sequence"]


class Timing(BaseModel):
    """Our additions to TGI's details."""

    use_cache: bool
    cached_tokens: int  # prompt tokens whose keys and values came from the prefix cache
    draft_tokens: int = 0  # speculative draft tokens verified for this request
    accepted_draft_tokens: int = 0  # of those, accepted: generated tokens that took no step of their own
    queue_time_s: float | None
    time_to_first_token_s: float | None
    e2e_latency_s: float | None
    tokens_per_s: float | None  # generated tokens / seconds from taking a slot to the last token


class AttentionWeights(BaseModel):
    """Our addition: what the generated tokens attended to, from one uncached recompute of prompt +
    generated ids. Query j is the token at position query_start + j (the first generated tokens, at most
    `server.engine.attention_rows.MAX_ATTENTION_QUERIES`); keys are positions 0..len(tokens)-1."""

    tokens: list[str]  # text of every token (prompt, then generated) up to the last query
    query_start: int  # position of the first query token = prompt length
    layers: int
    heads: int
    weights: list[list[list[list[float]]]]  # [layer][head][query][key], rows sum to 1, 0 on the future, 4 decimals


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: TGIFinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = None


class Details(Timing):
    finish_reason: TGIFinishReason
    generated_tokens: int
    seed: int | None
    input_length: int
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = None  # with parameters.top_n_tokens
    best_of_sequences: list[BestOfSequence] | None = None  # with parameters.best_of
    attention: AttentionWeights | None = None  # with parameters.return_attention


class StreamDetails(Timing):
    finish_reason: TGIFinishReason
    generated_tokens: int
    seed: int | None
    input_length: int
    attention: AttentionWeights | None = None  # with parameters.return_attention


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(BaseModel):
    """TGI's error shape, on its routes and /health, /info, /metrics."""

    error: str
    error_type: str  # validation, overloaded, unavailable, timeout, unauthorized, payload_too_large, ...


class HealthResponse(BaseModel):
    """{"status": "ok"}, and under `python -m server.cluster` the replicas' counts beside it."""

    model_config = ConfigDict(extra="allow")
    status: Literal["ok"]
