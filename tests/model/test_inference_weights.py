"""The inference-only weight copies (column-blocked Linear weights, the blocked head) compute what the
parameters compute."""
from __future__ import annotations

import copy

import pytest
import torch

from model.generate import decode_one_token, full_recompute, prefill
from model.gpt import GPT, Linear, pairwise_sum
from model.kv_cache import KVCache


@pytest.mark.parametrize("rows", [(1, 1), (3, 5)])
def test_column_blocked_linear_matches_addmm(rows):
    torch.manual_seed(0)
    layer = Linear(32, 96)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(*rows, 32)
    expected = x @ layer.weight + layer.bias  # (*rows, 96)
    layer.split_for_inference(4)
    layer.eval()
    assert layer.split_weight.shape == (4, 32, 24)
    out = layer(x)
    assert out.shape == (*rows, 96)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-6)


def test_blocks_follow_the_thread_count_and_fall_back_when_they_do_not_divide(tiny_config):
    model = GPT(tiny_config).prepare_for_inference(threads=2)
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.split_weight.shape == (2, 32, 48)
    model.prepare_for_inference(threads=3)  # 96 columns split in 3; the 32-column c_proj cannot be
    assert c_attn.split_weight.shape == (3, 32, 32)
    assert model.transformer.h[0].attn.c_proj.split_weight is None
    model.prepare_for_inference(threads=1)
    assert c_attn.split_weight is None


def test_prepared_model_gives_the_logits_of_the_plain_one(tiny_config):
    torch.manual_seed(0)
    plain = GPT(tiny_config).eval()
    prepared = copy.deepcopy(plain).prepare_for_inference(threads=2)
    ids = torch.randint(0, tiny_config.vocab_size, (2, 20))
    torch.testing.assert_close(prepared(ids), plain(ids), atol=1e-5, rtol=0)


def test_training_mode_multiplies_the_parameters_not_the_stale_copies(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config).prepare_for_inference(threads=2)
    model.train()
    ids = torch.randint(0, tiny_config.vocab_size, (1, 8))
    model(ids).sum().backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.zero_()
    before = model(ids)
    model.prepare_for_inference(threads=2)
    torch.testing.assert_close(model(ids), before.detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_pairwise_sum_adds_every_block(blocks):
    parts = torch.randn(blocks, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(pairwise_sum(parts), parts.sum(0), atol=1e-12, rtol=0)


def test_prepared_model_decodes_a_ragged_gathered_batch_as_each_sequence_alone(tiny_config):
    """The column-blocked weights and the blocked head on the cached path: rows at different lengths,
    slots that are not a range (a gather), padding in the prefill."""
    torch.manual_seed(0)
    model = GPT(tiny_config).prepare_for_inference(threads=2)
    lengths, slots = [7, 3], torch.tensor([2, 0])
    ids = torch.randint(0, tiny_config.vocab_size, (2, 10))
    positions = torch.full((2, 7), -1)
    for row, n in enumerate(lengths):
        positions[row, :n] = torch.arange(n)
    cache = KVCache(tiny_config, num_slots=3, max_len=32)
    with torch.inference_mode():
        prefill(model, cache, ids[:, :7], positions, slots, torch.tensor(lengths) - 1)
        for step in range(3):
            pos = torch.tensor(lengths) + step  # (2,)
            tokens = ids[torch.arange(2), pos]  # (2,)
            logits = decode_one_token(model, cache, tokens, pos, slots, kv_len=int(pos.max()) + 1)  # (2, V)
            for row in range(2):
                alone = full_recompute(model, ids[row: row + 1, : int(pos[row]) + 1])[0]  # (V,)
                torch.testing.assert_close(logits[row], alone, atol=1e-5, rtol=0, msg=lambda m: f"row {row}: {m}")


def test_a_slice_of_slots_must_match_the_batch(tiny_config):
    model = GPT(tiny_config).prepare_for_inference(threads=2)
    cache = KVCache(tiny_config, num_slots=4, max_len=16)
    with pytest.raises(ValueError, match="hold 3 rows, the batch has 2"):
        decode_one_token(model, cache, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                         slice(0, 3), kv_len=1)
