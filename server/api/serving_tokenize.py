"""vLLM's tokenizer routes: text or chat messages to token ids, ids back to text, and the tokenizer's
special tokens and chat template, so that a client needs no copy of the tokenizer."""

from __future__ import annotations

from model.config import GPT2_ARCHITECTURE
from model.tokenizer import TokenizerError
from server.api.encoding import encode
from server.api.engine_client import EngineClient
from server.api.errors import APIError
from server.api.model_names import ServedNames
from server.api.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from server.api.serving_chat import chat_prompt

GPT2_TOKENIZER_CLASS = "GPT2Tokenizer"  # the class transformers' AutoTokenizer loads a gpt2 checkpoint's tokenizer as
FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # a tokenizer.json of another family, without a tokenizer_class


async def tokenize(body: TokenizeRequest, engine: EngineClient, names: ServedNames) -> TokenizeResponse:
    names.check(body.model)
    text = (
        body.prompt
        if body.messages is None
        else chat_prompt(engine, body.messages, body.add_generation_prompt, names.primary)
    )
    special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
    ids = await encode(engine, text, special)
    strs = [engine.tokenizer.hf.id_to_token(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.context_length, tokens=ids, token_strs=strs)


def detokenize(body: DetokenizeRequest, engine: EngineClient, names: ServedNames) -> DetokenizeResponse:
    names.check(body.model)
    try:
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))
    except TokenizerError as e:
        raise APIError(422, f"tokens: {e}", "validation") from e


def tokenizer_info(engine: EngineClient) -> TokenizerInfo:
    tok, config = engine.tokenizer, engine.model_config
    bos = tok.bos_token
    if bos is None and config.bos_token_id is not None and 0 <= config.bos_token_id < tok.vocab_size:
        bos = tok.decode([config.bos_token_id])  # config.json's, where tokenizer_config.json names none
    default_class = GPT2_TOKENIZER_CLASS if config.architecture == GPT2_ARCHITECTURE else FAST_TOKENIZER_CLASS
    return TokenizerInfo(
        tokenizer_class=tok.tokenizer_class or default_class,
        vocab_size=tok.vocab_size,
        model_max_length=engine.context_length,
        eos_token=tok.eos_token,
        bos_token=bos,
        chat_template=tok.chat_template,
    )
