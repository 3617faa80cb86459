"""Attention weights of a finished generation, for `parameters.return_attention` and the playground.

One uncached recompute of prompt + generated ids gives exactly the weights each token had when it was
generated. It runs on the engine thread between steps (the engine owns the model), only for requests
that ask, and is cut to the first generated tokens and rounded so the payload stays bounded:
at most n_layer * n_head * MAX_ATTENTION_QUERIES * context_length numbers.
"""

from __future__ import annotations

import asyncio

import torch

from model.attention import attention_weights
from model.gpt import GPT
from server.api.protocol import AttentionWeights
from server.engine import Engine

MAX_ATTENTION_QUERIES = 64  # generated tokens whose rows are returned (the first ones)
ATTENTION_DECIMALS = 4


def generated_token_rows(model: GPT, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Weights of the first generated tokens (as queries) over every earlier position, rounded, on the CPU:
    (n_layer, n_head, Q, P + Q) with P = len(prompt_ids), Q = min(len(output_ids), MAX_ATTENTION_QUERIES)."""
    num_queries = min(len(output_ids), MAX_ATTENTION_QUERIES)
    weights = attention_weights(model, prompt_ids + output_ids[:num_queries])  # (L, nh, P+Q, P+Q)
    rows = weights[:, :, len(prompt_ids) :].cpu().double()  # (L, nh, Q, P+Q); double: 0.1235 stays 0.1235 in JSON
    return rows.round(decimals=ATTENTION_DECIMALS)


def _payload(engine: Engine, rows: torch.Tensor, prompt_ids: list[int], output_ids: list[int]) -> AttentionWeights:
    layers, heads, num_queries, num_keys = rows.shape
    ids = (prompt_ids + output_ids)[:num_keys]
    return AttentionWeights(
        tokens=[engine.tokenizer.decode([i]) for i in ids],
        query_start=len(prompt_ids),
        layers=layers,
        heads=heads,
        weights=rows.tolist(),
    )


async def attention_of_generation(engine: Engine, prompt_ids: list[int], output_ids: list[int]) -> AttentionWeights:
    """Computes on the engine thread, awaits without blocking the event loop, and shapes the payload
    (nested lists of up to n_layer * n_head * 64 * context numbers) in a worker thread, off the loop."""
    future = engine.run_between_steps(lambda: generated_token_rows(engine.model, prompt_ids, output_ids))
    rows = await asyncio.wrap_future(future)  # (L, nh, Q, K)
    return await asyncio.to_thread(_payload, engine, rows, prompt_ids, output_ids)
