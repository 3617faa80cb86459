"""Ragged batches equal each sequence alone; later tokens never change earlier logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from model.generate import decode_one_token, prefill
from model.kv_cache import KVCache, slot_index


def test_ragged_batch_prefill_and_decode_match_each_sequence_alone(tiny_model):
    torch.manual_seed(2)
    V = tiny_model.config.vocab_size
    seqs = [torch.randint(0, V, (n,)) for n in (5, 17, 11)]  # prompts of different lengths
    steps = 12
    cont = [torch.randint(0, V, (steps,)) for _ in seqs]  # forced continuations
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)  # (B, T), right-padded
    pos = torch.full((len(seqs), T), -1)  # (B, T), -1 marks padding
    for i, s in enumerate(seqs):
        ids[i, : len(s)], pos[i, : len(s)] = s, torch.arange(len(s))
    cache = KVCache(tiny_model.config, num_slots=5)
    slots = torch.tensor([4, 0, 2])
    lengths = torch.tensor([len(s) for s in seqs])
    with torch.inference_mode():
        batched = [prefill(tiny_model, cache, ids, pos, slots, lengths - 1)]  # (B, V)
        for j in range(steps):
            tokens = torch.stack([c[j] for c in cont])  # (B,)
            batched.append(decode_one_token(tiny_model, cache, tokens, lengths + j, slots))
        for i, s in enumerate(seqs):
            alone = tiny_model(torch.cat([s, cont[i]])[None])[0]  # (n + steps, V)
            for j, logits in enumerate(batched):
                torch.testing.assert_close(logits[i], alone[len(s) - 1 + j], atol=1e-5, rtol=0,
                                           msg=lambda m: f"row {i} step {j}: {m}")


def test_uncached_ragged_batch_matches_each_sequence_alone(tiny_model):
    V = tiny_model.config.vocab_size
    a, b = torch.randint(0, V, (7,)), torch.randint(0, V, (12,))
    ids = torch.zeros(2, 12, dtype=torch.long)
    pos = torch.full((2, 12), -1)
    ids[0, :7], pos[0, :7] = a, torch.arange(7)
    ids[1], pos[1] = b, torch.arange(12)
    with torch.inference_mode():
        out = tiny_model(ids, pos)  # (2, 12, V)
        torch.testing.assert_close(out[0, :7], tiny_model(a[None])[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], tiny_model(b[None])[0], atol=1e-5, rtol=0)
        assert not out.isnan().any(), "padding rows produced NaN"


def test_changing_a_later_token_never_changes_earlier_logits(tiny_model):
    V = tiny_model.config.vocab_size
    ids = torch.randint(0, V, (1, 40))
    changed = ids.clone()
    changed[0, 25:] = (changed[0, 25:] + 1) % V
    with torch.inference_mode():
        before, after = tiny_model(ids)[0], tiny_model(changed)[0]
    torch.testing.assert_close(before[:25], after[:25], atol=0, rtol=0)
    assert not torch.allclose(before[25:], after[25:]), "the changed tokens had no effect at all"


def test_attention_row_with_no_visible_key_is_zero_not_nan():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :2] = True  # only query 1 sees anything
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not out.isnan().any()
    assert out[:, :, 0].abs().max() == 0 and out[:, :, 2].abs().max() == 0


def test_padding_tokens_never_overwrite_a_real_cache_position(tiny_model):
    """A padded row writes to the scratch column, so another row's real entries stay intact."""
    V = tiny_model.config.vocab_size
    cache = KVCache(tiny_model.config, num_slots=2, max_len=16)
    ids = torch.randint(0, V, (2, 16))
    pos = torch.full((2, 16), -1)
    pos[0] = torch.arange(16)  # fills the slot up to its last column
    pos[1, :3] = torch.arange(3)
    with torch.inference_mode():
        prefill(tiny_model, cache, ids, pos, torch.tensor([0, 1]), torch.tensor([15, 2]))
        alone = KVCache(tiny_model.config, num_slots=1, max_len=16)
        prefill(tiny_model, alone, ids[:1], pos[:1], torch.tensor([0]), torch.tensor([15]))
    for layer, alone_layer in zip(cache.layers, alone.layers):  # keys and values of slot 0
        torch.testing.assert_close(layer[0, :, :, :16], alone_layer[0, :, :, :16], atol=1e-6, rtol=0)


def test_slots_are_handed_out_lowest_first_and_read_as_a_slice_when_contiguous(tiny_model):
    cache = KVCache(tiny_model.config, num_slots=4)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    cache.free(1)
    assert cache.allocate() == 1, "a freed low slot is reused before higher ones"
    assert slot_index([1, 2, 3]) == slice(1, 4) and slot_index([0, 2]) is None and slot_index([2, 1]) is None
