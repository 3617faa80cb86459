"""Attention weights of a finished generation, for people to look at (`parameters.return_attention` and
the playground).

One uncached recompute of prompt + generated ids gives exactly the weights each token had when it was
generated. It runs on the engine thread between steps (`Engine.attention_rows`: the engine owns the
model), only for requests that ask, and is cut to the first generated tokens and rounded so the payload
stays bounded: at most num_layers * num_heads * MAX_ATTENTION_QUERIES * context_length numbers (query heads:
a grouped-query model's heads of one group share their keys but not their weights).
"""

from __future__ import annotations

import torch

from model.attention import attention_weights
from model.description import InferenceModel

MAX_ATTENTION_QUERIES = 64  # generated tokens whose rows are returned (the first ones)
ATTENTION_DECIMALS = 4


def generated_token_rows(model: InferenceModel, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Weights of the first generated tokens (as queries) over every earlier position, rounded, on the CPU:
    (num_layers, num_heads, Q, P + Q) with P = len(prompt_ids), Q = min(len(output_ids), MAX_ATTENTION_QUERIES)."""
    num_queries = min(len(output_ids), MAX_ATTENTION_QUERIES)
    weights = attention_weights(model, prompt_ids + output_ids[:num_queries])  # (L, nh, P+Q, P+Q)
    rows = weights[:, :, len(prompt_ids) :].cpu().double()  # (L, nh, Q, P+Q); double: 0.1235 stays 0.1235 in JSON
    return rows.round(decimals=ATTENTION_DECIMALS)
