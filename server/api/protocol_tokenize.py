"""Schemas of vLLM's tokenizer routes (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`), which
evaluation and load tools (lm-eval's remote tokenizer among them) use instead of loading the tokenizer."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.api.protocol import Strict
from server.api.protocol_openai import ChatMessage

TokenId = Annotated[int, Field(ge=0)]


class TokenizeRequest(Strict):
    """vLLM's two forms in one: `prompt` (text), or `messages` rendered through the chat template."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = Field(None, description="optional; a name this server does not serve is a 404")
    # not nullable: exactly one of the two is given (the schema's oneOf)
    prompt: str = Field(None, description="the text to tokenize (or give messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        None, description="chat messages, rendered through the checkpoint's chat template, then tokenized"
    )
    add_generation_prompt: bool = Field(True, description="with messages: the template's cue for the reply")
    add_special_tokens: bool | None = Field(
        None,
        description="add the special tokens the tokenizer puts around a prompt (a BOS, where the checkpoint's "
        "tokenizer adds one); default: true for a prompt, false for messages (the chat template writes them), "
        "as vLLM",
    )
    return_token_strs: bool = Field(False, description="also return each token's vocabulary entry")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int  # len(tokens)
    max_model_len: int  # the context, in tokens: prompt and generated tokens together
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: each token's vocabulary entry


class DetokenizeRequest(Strict):
    model: str | None = Field(None, description="optional; a name this server does not serve is a 404")
    tokens: list[TokenId] = Field(description="token ids, each below the vocabulary size")


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What a client needs to tokenize as the server does, without the tokenizer's files."""

    tokenizer_class: str  # the transformers class that loads this checkpoint's tokenizer.json
    vocab_size: int
    model_max_length: int  # the context, in tokens
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None = None  # GPT-2 has none
    unk_token: str | None = None  # byte-level BPE needs none
    chat_template: str | None  # the checkpoint's Jinja template, or None without one
