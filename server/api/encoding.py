"""Text to token ids on the event loop, or off it for long texts."""

from __future__ import annotations

import asyncio

from server.api.engine_client import EngineClient

LONG_TEXT = 16_384  # characters: longer prompts are tokenized off the event loop


async def encode(engine: EngineClient, text: str) -> list[int]:
    if len(text) > LONG_TEXT:
        return await asyncio.to_thread(engine.tokenizer.encode, text)
    return engine.tokenizer.encode(text)
