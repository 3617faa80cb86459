"""The packed weights' arena: copies that keep every byte, start on a cache line, share 2 MiB-aligned
chunks, and ask Linux for huge pages where its transparent huge pages allow it; a model's step reads
the same bits from there as from plain memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.kernels import PackedWeight
from model.kernels.arena import ALIGN, CHUNK, HUGE_PAGE, WeightArena
from model.kernels.exact import ExactBackend
from tests.conftest import needs_exact

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages, or None where the file is absent."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_place_copies_bytes_into_aligned_shared_chunks():
    arena = WeightArena()
    tensors = [
        torch.randn(3, 5),
        torch.randn(7).to(torch.bfloat16),
        torch.randint(-128, 127, (4, 9, 2), dtype=torch.int8),
        torch.randn(2, 2),
    ]
    placed = [arena.place(t) for t in tensors]
    for src, dst in zip(tensors, placed):
        assert dst.dtype == src.dtype and dst.shape == src.shape
        assert torch.equal(dst, src)
        assert dst.data_ptr() != src.data_ptr()
        assert dst.data_ptr() % ALIGN == 0
    assert len(arena.chunks) == 1 and arena.chunks[0].data_ptr() % HUGE_PAGE == 0
    src = tensors[0].clone()
    tensors[0].add_(1.0)  # the arena holds a copy, not a view of the source
    assert torch.equal(placed[0], src)


def test_a_weight_larger_than_a_chunk_gets_its_own():
    arena = WeightArena()
    small = arena.place(torch.ones(16))
    big = arena.place(torch.ones(CHUNK // 4 + 1))  # float32: one element past a chunk
    assert len(arena.chunks) == 2
    assert arena.chunks[1].numel() >= CHUNK + 4 and arena.chunks[1].numel() % HUGE_PAGE == 0
    assert small.sum() == 16 and big.sum() == CHUNK // 4 + 1


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages: {thp_mode()}")
def test_chunks_are_advised_for_huge_pages_where_linux_allows():
    arena = WeightArena()
    arena.place(torch.ones(8))
    assert arena.advised == 1


@needs_exact
def test_backend_weights_live_in_its_arena():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_positions=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    backend = ExactBackend(model)
    chunk = backend.arena.chunks[0]
    start, end = chunk.data_ptr(), chunk.data_ptr() + chunk.numel()
    weights = [backend.head] + [p for b in backend._keep[2] for p in b.values() if isinstance(p, PackedWeight)]
    assert all(start <= w.weight.data_ptr() < end for w in weights)
    assert torch.equal(backend.head.weight, PackedWeight.pack(model.transformer.wte.weight.t()).weight)
