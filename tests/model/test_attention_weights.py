"""Returned attention weights are the model's: rows sum to 1, zero on the future, equal to Q·K by hand."""

from __future__ import annotations

import torch

from model.attention import attention_weights


def reference_weights(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Recomputes each layer's softmax(QK^T / sqrt(d)) from the weights, the textbook way."""
    out, x = [], model.transformer.wte(ids) + model.transformer.wpe(torch.arange(ids.shape[1], device=ids.device))
    T = ids.shape[1]
    for block in model.transformer.h:
        h = block.ln_1(x)
        q, k, _ = (h @ block.attn.c_attn.weight + block.attn.c_attn.bias).split(model.config.n_embd, dim=-1)
        q = q.view(1, T, model.config.n_head, -1).transpose(1, 2)  # (1, nh, T, hs)
        k = k.view(1, T, model.config.n_head, -1).transpose(1, 2)  # (1, nh, T, hs)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (1, nh, T, T)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=ids.device), diagonal=1)
        out.append(scores.masked_fill(future, float("-inf")).softmax(-1)[0])
        x = block(x)
    return out


def test_weights_are_distributions_over_the_past_equal_to_reference(tiny_model, device):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 30), device=device)
    weights = attention_weights(tiny_model, ids[0].tolist())  # (L, nh, T, T)
    assert weights.shape == (2, 4, 30, 30)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 30, device=device))
    assert (weights.triu(diagonal=1) == 0).all(), "a token attended to a future position"
    with torch.inference_mode():
        for layer, ref in enumerate(reference_weights(tiny_model, ids)):
            torch.testing.assert_close(
                weights[layer], ref, atol=1e-6, rtol=0, msg=lambda m, layer=layer: f"layer {layer}: {m}"
            )


def test_explicit_attention_path_gives_the_same_logits_as_the_fused_one(tiny_model, device):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 30), device=device)
    with torch.inference_mode():
        torch.testing.assert_close(tiny_model(ids, attention_out=[]), tiny_model(ids), atol=1e-5, rtol=0)
