"""Text to token ids on the event loop, or off it for long texts."""

from __future__ import annotations

import asyncio

from server.api.engine_client import EngineClient

LONG_TEXT = 16_384  # characters: longer prompts are tokenized off the event loop


async def encode(engine: EngineClient, text: str, add_special_tokens: bool) -> list[int]:
    """`add_special_tokens`: those the tokenizer puts around a prompt (the checkpoint's BOS, where it adds one);
    False for text rendered from a chat template, which writes its own."""
    if len(text) > LONG_TEXT:
        return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens)
    return engine.tokenizer.encode(text, add_special_tokens)
