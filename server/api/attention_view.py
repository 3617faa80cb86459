"""Attention weights of a finished generation as the API's payload, for `parameters.return_attention` and
the playground: the engine computes the rows (`EngineClient.attention_rows`,
server/engine/attention_rows.py), this module shapes them."""

from __future__ import annotations

import asyncio

import torch

from server.api.engine_client import EngineClient
from server.api.protocol import AttentionWeights


def _payload(
    engine: EngineClient, rows: torch.Tensor, prompt_ids: list[int], output_ids: list[int]
) -> AttentionWeights:
    layers, heads, num_queries, num_keys = rows.shape
    ids = (prompt_ids + output_ids)[:num_keys]
    return AttentionWeights(
        tokens=[engine.tokenizer.decode([i]) for i in ids],
        query_start=len(prompt_ids),
        layers=layers,
        heads=heads,
        weights=rows.tolist(),
    )


async def attention_of_generation(
    engine: EngineClient, prompt_ids: list[int], output_ids: list[int]
) -> AttentionWeights:
    """Computes on the engine thread, awaits without blocking the event loop, and shapes the payload
    (nested lists of up to num_layers * num_heads * 64 * context numbers) in a worker thread, off the loop."""
    rows = await engine.attention_rows(prompt_ids, output_ids)  # (L, nh, Q, K)
    return await asyncio.to_thread(_payload, engine, rows, prompt_ids, output_ids)
