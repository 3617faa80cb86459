"""One flattened step: any mix of decode rows, prompt chunks and whole recomputes gives each sequence
what it gets alone; later tokens never change earlier logits; no attention row is ever fully masked."""

from __future__ import annotations

import torch

from model.gpt import GPT
from model.kernels import stock
from model.kv_cache import PagedKVCache, StepBatch
from tests.conftest import EXACT, random_model


def logits_of_step(model: GPT, cache: PagedKVCache, sequences) -> list[torch.Tensor]:
    """sequences: (new token ids, first position, blocks). Returns each sequence's last-token logits."""
    step = StepBatch.build(sequences, cache.block_size, model.device)
    hidden = model.forward_step(step, cache)
    return list(model.compute_logits(hidden[step.query_start[1:].long() - 1]).split(1))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit with the exact kernels; within the stock kernels' tolerance otherwise."""
    return torch.equal(a, b) if EXACT else torch.allclose(a, b, atol=1e-4, rtol=0)


def test_a_mixed_step_gives_each_sequence_the_logits_it_gets_alone(tiny_model):
    """A decode row, a prompt chunk after a cached prefix, and an uncached recompute, in one forward."""
    model, V = tiny_model, tiny_model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    decode_seq, chunk_seq, recompute_seq = (torch.randint(0, V, (n,), generator=g).tolist() for n in (30, 50, 41))
    shared = PagedKVCache(model.config, 32, 16, device=model.device)
    blocks = {"decode": [0, 1], "chunk": [5, 6, 7, 8], "recompute": [20, 21, 22]}
    logits_of_step(model, shared, [(decode_seq[:29], 0, blocks["decode"]), (chunk_seq[:20], 0, blocks["chunk"])])
    mixed = logits_of_step(
        model,
        shared,
        [
            (decode_seq[29:], 29, blocks["decode"]),
            (chunk_seq[20:], 20, blocks["chunk"]),
            (recompute_seq, 0, blocks["recompute"]),
        ],
    )
    for got, seq, name in zip(mixed, (decode_seq, chunk_seq, recompute_seq), blocks):
        alone = logits_of_step(
            model, PagedKVCache(model.config, 8, 16, device=model.device), [(seq, 0, list(range(-(-len(seq) // 16))))]
        )[0]
        assert same(got, alone), f"the {name} row differs from the sequence alone"


def test_changing_a_later_token_never_changes_earlier_logits(tiny_model):
    model = tiny_model
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    changed = ids[:25] + [(ids[25] + 1) % model.config.vocab_size] + ids[26:]
    outs = []
    for seq in (ids, changed):
        step = StepBatch.build([(seq, 0, [0, 1, 2])], 16, model.device)
        outs.append(
            model.compute_logits(model.forward_step(step, PagedKVCache(model.config, 3, 16, device=model.device)))
        )
    assert same(outs[0][:25], outs[1][:25])
    assert not torch.equal(outs[0][25:], outs[1][25:])


def test_no_padded_attention_row_is_fully_masked():
    query_start = torch.tensor([0, 1, 5, 6])  # query lengths 1, 4, 1
    seq_lens = torch.tensor([10, 4, 33])
    visible = stock.padded_visibility(query_start, seq_lens, 4, 48)  # (S, Q, K)
    assert visible.any(-1).all(), "a query row sees no key"
    assert visible[0, 0].nonzero().flatten().tolist() == list(range(10))  # decode at position 9
    assert [visible[1, j].sum().item() for j in range(4)] == [1, 2, 3, 4]  # a prompt chunk from 0
    assert visible[2, 0].sum().item() == 33
    assert visible[0, 1:].sum(-1).tolist() == [1, 1, 1]  # padding rows: key 0 only


def test_stock_attention_of_a_mixed_step_is_finite_and_matches_the_reference(tiny_config):
    model = random_model(tiny_config, seed=3, kernels_name="stock")
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    reference = model(ids.to(model.device))[:, -1].float()  # (2, V)
    cache = PagedKVCache(model.config, 8, 16, device=model.device)
    got = logits_of_step(model, cache, [(ids[0, :29].tolist(), 0, [0, 1]), (ids[1].tolist(), 0, [4, 5])])
    assert torch.isfinite(got[1]).all()
    torch.testing.assert_close(got[1][0], reference[1], atol=1e-4, rtol=0)
