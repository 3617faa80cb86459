"""The decoder families' inference path (CausalLM.prepare_for_inference, forward_step over the paged KV cache,
compute_logits): the interface GPT has, and the stock step's logits within 1e-4 of the reference forward for
each family, over prefills, decode steps and a mixed step of several sequences."""

from __future__ import annotations

import pytest
import torch

from model.kv_cache import PagedKVCache, StepBatch
from tests.conftest import TEST_DEVICE
from tests.model.hf_families import CASES, VOCAB, random_decoder

BS = 16


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def stock_model(request):
    return random_decoder(request.param, device=TEST_DEVICE).prepare_for_inference("stock")


def test_a_family_model_has_the_inference_interface_of_gpt(stock_model):
    model = stock_model
    assert model.prepare_for_inference("stock") is model
    assert (model.kernels, model.kernel_isa, model.quantization) == ("stock", None, None)
    assert model.device == torch.device(TEST_DEVICE) and model.dtype == torch.float32
    cache = PagedKVCache(model.config, 2, BS, device=model.device)
    step = StepBatch.build([(random_ids(5, 0), 0, [1]), (random_ids(3, 1), 0, [0])], BS, model.device)
    hidden = model.forward_step(step, cache)
    assert hidden.shape == (8, model.config.hidden_size)
    logits = model.compute_logits(hidden[[4, 7]])
    assert logits.shape == (2, VOCAB) and logits.dtype == torch.float32


def reference_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device))[0, -1:].float()  # (1, V)


def test_stock_step_matches_the_reference_forward(stock_model):
    """Two prompts prefilled in one step (one in two chunks), then decoded together: every step's
    logits within 1e-4 of the reference forward over the whole sequence."""
    model = stock_model
    a, b = random_ids(60, 2), random_ids(45, 3)
    cache = PagedKVCache(model.config, 10, BS, device=model.device)
    blocks_a, blocks_b = [7, 2, 5, 0], [1, 9, 4]
    model.forward_step(StepBatch.build([(a[:20], 0, blocks_a)], BS, model.device), cache)
    step = StepBatch.build([(a[20:30], 20, blocks_a), (b[:30], 0, blocks_b)], BS, model.device)
    hidden = model.forward_step(step, cache)
    logits = model.compute_logits(hidden[step.query_start[1:].long() - 1])  # (2, V)
    torch.testing.assert_close(logits[0:1], reference_last_logits(model, a[:30]), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1:2], reference_last_logits(model, b[:30]), atol=1e-4, rtol=0)
    for t in range(30, 45):
        step = StepBatch.build([([b[t]], t, blocks_b), ([a[t]], t, blocks_a)], BS, model.device)
        logits = model.compute_logits(model.forward_step(step, cache))  # (2, V)
        torch.testing.assert_close(logits[1:2], reference_last_logits(model, a[: t + 1]), atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[0:1], reference_last_logits(model, b[: t + 1]), atol=1e-4, rtol=0)
