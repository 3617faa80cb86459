"""Attention weights for inspection: which earlier tokens each token attended to, per layer and query head."""

from __future__ import annotations

import torch

from model.description import InferenceModel
from model.gpt import GPT


@torch.inference_mode()
def attention_weights(model: InferenceModel, ids: list[int]) -> torch.Tensor:
    """Weights of every layer and query head for one sequence, uncached: (num_layers, num_heads, T, T).
    Row t is a probability distribution over positions 0..t (zero on future positions)."""
    if isinstance(model, GPT):
        weights: list[torch.Tensor] = []
        model(torch.tensor([ids], device=model.device), attention_out=weights)
        return torch.stack([w[0] for w in weights]).float()  # (L, nh, T, T)
    return _decoder_attention_weights(model, ids)


def _decoder_attention_weights(model, ids: list[int]) -> torch.Tensor:
    """The decoder families' (model/models): the reference forward runs once, and each layer's attention
    input is taken as it enters (a forward hook) and turned into its weights by the layer's own projection
    (q, and k rotated, QK-normed where the model does), a softmax spelled out in float32. A query head reads
    the key head of its group."""
    inputs: list[tuple] = []
    hooks = [
        layer.self_attn.register_forward_hook(lambda _module, args, _out: inputs.append(args))
        for layer in model.model.layers
    ]
    try:
        model(torch.tensor([ids], device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    T = len(ids)
    future = torch.ones(T, T, dtype=torch.bool, device=model.device).triu(1)  # (T, T)
    weights = []
    for layer, args in zip(model.model.layers, inputs):
        attn = layer.self_attn
        q, k, _ = attn.project(*args)  # (1, T, nh, hd), (1, T, nkv, hd)
        q, k = q[0].transpose(0, 1).float(), k[0].transpose(0, 1).float()  # (nh, T, hd), (nkv, T, hd)
        k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=0)  # (nh, T, hd)
        scores = (q @ k.transpose(-2, -1)) * attn.head_dim**-0.5  # (nh, T, T)
        weights.append(scores.masked_fill(future, float("-inf")).softmax(dim=-1))  # (nh, T, T)
    return torch.stack(weights)  # (L, nh, T, T)
