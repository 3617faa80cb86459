"""Attention weights for inspection: which earlier tokens each token attended to, per layer and head."""

from __future__ import annotations

import torch

from model.gpt import GPT


@torch.inference_mode()
def attention_weights(model: GPT, ids: list[int]) -> torch.Tensor:
    """Weights of every layer and head for one sequence, uncached: (n_layer, n_head, T, T).
    Row t is a probability distribution over positions 0..t (zero on future positions)."""
    device = next(model.parameters()).device
    weights: list[torch.Tensor] = []
    model(torch.tensor([ids], device=device), attention_out=weights)
    return torch.stack([w[0] for w in weights]).float()  # (L, nh, T, T)
