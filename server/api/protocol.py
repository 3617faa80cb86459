"""Request and response schemas: Hugging Face TGI's (`/generate`, `/generate_stream`, `/`) and OpenAI's
completions (`/v1/completions`, `/v1/models`). Routes live in `server.api.app`, the logic in `server.api.serving`.

Unknown fields are refused (422) rather than ignored. Fields TGI or OpenAI define that this server does
not implement are accepted only at their neutral value, so a client sending defaults works.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NonEmptyStr = Annotated[str, Field(min_length=1)]
TIMEOUT_DOC = "our extension: seconds before the request is cut short (error_type timeout), at most --request-timeout"
CACHE_SALT_DOC = ("vLLM's extension: prefix-cache hits only among requests with the same salt (isolates "
                  "tenants, or measures the cache without prefix reuse)")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _refuse_unsupported(model: BaseModel, neutral: dict[str, tuple]) -> None:
    for name, allowed in neutral.items():
        value = getattr(model, name)
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported by this server (use one of {list(allowed)})")


# ---- TGI ----------------------------------------------------------------------------------------


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
    return_attention: bool = Field(False, description="our extension: attention weights of the first generated "
                                   "tokens in details.attention (turns details on)")
    ignore_eos: bool = Field(False, description="our extension (vLLM's): generate max_new_tokens whatever comes")
    timeout: float | None = Field(None, gt=0, description=TIMEOUT_DOC)
    cache_salt: NonEmptyStr | None = Field(None, description=CACHE_SALT_DOC)
    # TGI fields accepted at their neutral value only
    best_of: int | None = None
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    frequency_penalty: float | None = None
    grammar: Any = None
    adapter_id: str | None = None

    @model_validator(mode="after")
    def _neutral_only(self) -> "GenerateParameters":
        _refuse_unsupported(self, {"best_of": (None, 1), "decoder_input_details": (False,),
                                   "top_n_tokens": (None, 0), "typical_p": (None, 1.0), "watermark": (False,),
                                   "frequency_penalty": (None, 0.0), "grammar": (None,), "adapter_id": (None,)})
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


TGIFinishReason = Literal["length", "eos_token", "stop_sequence"]


class Timing(BaseModel):
    """Our additions to TGI's details."""

    use_cache: bool
    cached_tokens: int  # prompt tokens whose keys and values came from the prefix cache
    queue_time_s: float | None
    time_to_first_token_s: float | None
    e2e_latency_s: float | None
    tokens_per_s: float | None  # generated tokens / seconds from taking a slot to the last token


class AttentionWeights(BaseModel):
    """Our addition: what the generated tokens attended to, from one uncached recompute of prompt +
    generated ids. Query j is the token at position query_start + j (the first generated tokens, at most
    `server.api.attention_view.MAX_ATTENTION_QUERIES`); keys are positions 0..len(tokens)-1."""

    tokens: list[str]  # text of every token (prompt, then generated) up to the last query
    query_start: int  # position of the first query token = prompt length
    layers: int
    heads: int
    weights: list[list[list[list[float]]]]  # [layer][head][query][key], rows sum to 1, 0 on the future, 4 decimals


class Details(Timing):
    finish_reason: TGIFinishReason
    generated_tokens: int
    seed: int | None
    input_length: int
    prefill: list[Token] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
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
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str


# ---- OpenAI completions -------------------------------------------------------------------------


class CompletionRequest(Strict):
    model: str
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0 means greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(None, description="at most --max-stop-sequences (4)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=0, description="0: the sampled token's logprob only")
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    # OpenAI fields accepted at their neutral value only
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    # our extensions (vLLM accepts the first two as well)
    top_k: int | None = Field(None, gt=0)
    repetition_penalty: float | None = Field(None, gt=0)
    use_cache: bool = True
    ignore_eos: bool = False
    timeout: float | None = Field(None, gt=0, description=TIMEOUT_DOC)
    cache_salt: NonEmptyStr | None = Field(None, description=CACHE_SALT_DOC)

    @model_validator(mode="after")
    def _neutral_only(self) -> "CompletionRequest":
        _refuse_unsupported(self, {"best_of": (None, 1), "presence_penalty": (None, 0.0),
                                   "frequency_penalty": (None, 0.0), "suffix": (None,)})
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        return self

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
