"""The paged KV cache: keys and values in a pool of fixed-size blocks, and the flattened step that
reads and writes them.

A sequence's keys and values live in the blocks its block table lists, in order: position p sits in
block `table[p // block_size]` at offset `p % block_size`. Which blocks a sequence holds is the
engine's business (server/engine/block_manager.py); this module only stores them.

A layer holds `num_kv_heads x head_dim` values per token for keys and as many for values (the model's
description, model/description.py): a grouped-query model (model/models) caches only its key/value
heads, each read in place by the query heads of its group, and its keys already rotated (RoPE applied
at their own positions); GPT-2 has as many key/value heads as query heads. The longest sequence is the
description's context_length.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

import torch

from model.description import ModelDescription

log = logging.getLogger("kvserve.kv_cache")

HUGE_PAGE = 2 << 20
SCALE_BYTES = 4  # an int8 cache's float32 scale per (token, head), for its keys and for its values
_MADV_HUGEPAGE = 14
# The default KV cache (no --kv-cache-memory): room for AUTO_KV_SEQUENCES sequences at the model's
# full context, from its bytes per token, but at most AUTO_KV_FRACTION of the memory free at load
# (as vLLM's CPU backend sizes its cache from the machine's memory), and at least one sequence.
AUTO_KV_SEQUENCES = 32
AUTO_KV_FRACTION = 0.25


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes free for new allocations: the GPU's free memory, or Linux's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_kv_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's (None or 'auto'), 'bfloat16' under a float32 model, which
    halves the bytes a token holds and a step reads (keys and values rounded once, when written), or
    'int8' under a float32 or bfloat16 model, about half again (each token's head quantized once, when
    written, with a float32 scale: SCALE_BYTES more per head; the exact kernels only)."""
    if name in (None, "auto"):
        return model_dtype
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}.get(name)
    if dtype is None:
        raise ValueError(f"kv cache dtype must be auto, float32, bfloat16 or int8, got {name!r}")
    if dtype == torch.int8 and model_dtype in (torch.float32, torch.bfloat16):
        return dtype
    if dtype != model_dtype and (model_dtype, dtype) != (torch.float32, torch.bfloat16):
        raise ValueError(
            f"a {name} KV cache under a {str(model_dtype).removeprefix('torch.')} model: the cache "
            f"holds the model's dtype, bfloat16 under float32, or int8 under either"
        )
    return dtype


def auto_kv_cache_bytes(config: ModelDescription, dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The default KV cache size for a model: see AUTO_KV_SEQUENCES and AUTO_KV_FRACTION."""
    per_sequence = config.context_length * PagedKVCache.bytes_per_token(config, dtype)
    cap = int(available_memory(device) * AUTO_KV_FRACTION)
    return max(per_sequence, min(AUTO_KV_SEQUENCES * per_sequence, cap))


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, asking Linux for 2 MiB pages first on the CPU (where transparent huge pages are
    on 'madvise'): attention reads each sequence's blocks from all over a large cache, and small
    pages make that a TLB miss per block (BENCHMARKS.md)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel() * t.element_size() >= 2 * HUGE_PAGE and sys.platform == "linux":
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        try:
            ctypes.CDLL(None, use_errno=True).madvise(
                ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE
            )
        except (OSError, AttributeError):
            pass  # only a hint
    return t.zero_()


@dataclass
class StepBatch:
    """One forward over the new tokens of several sequences, back to back: N tokens, S sequences.
    The engine's tensors are its preallocated buffers, longer than the step: only their first
    num_tokens (per-token fields) or num_seqs (per-sequence fields) entries are this step's."""

    token_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64, each token's position in its own sequence
    slot_mapping: torch.Tensor  # (N,) int64, cache slot its keys/values are written to: block * block_size + offset
    query_start: torch.Tensor  # (S + 1,) int32, index of each sequence's first token; query_start[S] = N
    seq_lens: torch.Tensor  # (S,) int32, keys each sequence attends over after this step: last position + 1
    block_tables: torch.Tensor  # (rows, max_blocks) int32, block ids; a sequence's row lists its blocks in order
    seq_rows: torch.Tensor  # (S,) int32, each sequence's row in block_tables
    num_tokens: int  # N
    num_seqs: int  # S
    max_query_len: int  # the longest run of new tokens of one sequence (sizes the stock attention's padding)
    max_seq_len: int  # the largest seq_lens entry

    def trimmed(self) -> StepBatch:
        """The same step with tensors of exactly its sizes (views)."""
        N, S = self.num_tokens, self.num_seqs
        return StepBatch(
            self.token_ids[:N],
            self.positions[:N],
            self.slot_mapping[:N],
            self.query_start[: S + 1],
            self.seq_lens[:S],
            self.block_tables,
            self.seq_rows[:S],
            N,
            S,
            self.max_query_len,
            self.max_seq_len,
        )

    @classmethod
    def build(
        cls, sequences: list[tuple[list[int], int, list[int]]], block_size: int, device: torch.device | str = "cpu"
    ) -> StepBatch:
        """A step from plain lists, one entry per sequence: (its new token ids, the position of the
        first, its block table). For generate() and tests; the engine fills preallocated buffers."""
        ids, positions, slots, starts, lens = [], [], [], [0], []
        width = max(len(blocks) for _, _, blocks in sequences)
        tables = torch.zeros((len(sequences), width), dtype=torch.int32)
        for row, (tokens, start, blocks) in enumerate(sequences):
            span = range(start, start + len(tokens))
            ids += tokens
            positions += span
            slots += [blocks[p // block_size] * block_size + p % block_size for p in span]
            starts.append(starts[-1] + len(tokens))
            lens.append(start + len(tokens))
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return cls(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            torch.tensor(slots, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device),
            tables.to(device),
            torch.arange(len(sequences), dtype=torch.int32, device=device),
            len(ids),
            len(sequences),
            max(len(t) for t, _, _ in sequences),
            max(lens),
        )


class PagedKVCache:
    """`num_blocks` blocks of `block_size` tokens, allocated once, one tensor per layer:
    (num_blocks, 2, kv_heads, block_size * head_dim), keys then values. Within a block, a head's keys
    are stored transposed, [head_dim][block_size], and its values [block_size][head_dim]
    (model/kernels/csrc/attention.cpp says why). An int8 cache's head holds block_size float32 scales
    after them, as bytes: (num_blocks, 2, kv_heads, block_size * (head_dim + SCALE_BYTES))."""

    def __init__(
        self,
        config: ModelDescription,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.n_head, self.head_dim = config.num_kv_heads, config.head_dim  # n_head: the key/value heads cached
        if dtype == torch.int8 and torch.device(device).type != "cpu":
            raise ValueError("an int8 KV cache is read by the exact CPU kernels only")
        shape = (num_blocks, 2, config.num_kv_heads, block_size * self.head_bytes(config.head_dim, dtype))
        # One tensor per layer: each layer's attention writes and reads its own, in place.
        self.layers = [zeros_in_huge_pages(shape, dtype, device) for _ in range(config.num_layers)]
        log.info(
            "KV cache: %d blocks of %d tokens, %d tokens in all (%.1f MiB, %s)",
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.total_bytes() / 2**20,
            str(dtype).removeprefix("torch."),
        )

    @staticmethod
    def head_bytes(head_dim: int, dtype: torch.dtype) -> int:
        """Elements of one token's keys (or values) of one head: head_dim, and an int8 cache's scale."""
        return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim

    @classmethod
    def bytes_per_token(cls, config: ModelDescription, dtype: torch.dtype) -> int:
        """Keys and values of one token, all layers."""
        width = config.num_kv_heads * cls.head_bytes(config.head_dim, dtype)  # keys (or values), one layer
        return config.num_layers * 2 * width * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def bytes_per_block(cls, config: ModelDescription, block_size: int, dtype: torch.dtype) -> int:
        """Keys and values of `block_size` tokens, all layers."""
        return cls.bytes_per_token(config, dtype) * block_size

    @classmethod
    def blocks_for_memory(
        cls,
        config: ModelDescription,
        memory_bytes: int | None,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> int:
        """Blocks that fit in memory_bytes; None: the default size, auto_kv_cache_bytes."""
        if memory_bytes is None:
            memory_bytes = auto_kv_cache_bytes(config, dtype, device)
        return memory_bytes // cls.bytes_per_block(config, block_size, dtype)

    @classmethod
    def check_holds_a_context(
        cls, config: ModelDescription, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        """A ValueError naming --kv-cache-memory when `num_blocks` cannot hold one context-long sequence."""
        context = config.context_length
        longest = -(-context // block_size)
        if num_blocks < longest:
            per_block = cls.bytes_per_block(config, block_size, dtype)
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * per_block} "
                f"bytes), fewer than one {context}-token sequence needs ({longest} blocks, "
                f"{longest * per_block} bytes): raise --kv-cache-memory"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def total_bytes(self) -> int:
        return sum(layer.numel() * layer.element_size() for layer in self.layers)

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's keys (num_blocks, nh, hd, bs) (transposed) and values (num_blocks, nh, bs, hd);
        of an int8 cache, float32 copies: each value times its (token, head)'s scale."""
        kv = self.layers[layer]
        nb, bs, nh, hd = self.num_blocks, self.block_size, self.n_head, self.head_dim
        if self.dtype != torch.int8:
            return kv[:, 0].view(nb, nh, hd, bs), kv[:, 1].view(nb, nh, bs, hd)
        q, scales = kv[..., : hd * bs], kv[..., hd * bs :].contiguous().view(torch.float32)  # (nb, 2, nh, bs) scales
        keys = q[:, 0].reshape(nb, nh, hd, bs).float() * scales[:, 0, :, None, :]
        values = q[:, 1].reshape(nb, nh, bs, hd).float() * scales[:, 1, :, :, None]
        return keys, values

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Clears blocks (a failed request's, whose values may be NaN) so no later holder reads them."""
        if block_ids:
            index = torch.tensor(block_ids, device=self.device)
            for layer in self.layers:
                layer.index_fill_(0, index, 0)


def kv_cache_blocks(
    config: ModelDescription,
    block_size: int,
    dtype: torch.dtype,
    *,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """The block count of a KV cache for `config`: `num_blocks` outright, else what `memory_bytes` holds
    (None: the default size, auto_kv_cache_bytes). Every check of that size is made here: a ValueError
    naming --kv-cache-memory when it cannot hold one context-long sequence."""
    if not num_blocks:
        num_blocks = PagedKVCache.blocks_for_memory(config, memory_bytes, block_size, dtype, device)
    PagedKVCache.check_holds_a_context(config, num_blocks, block_size, dtype)
    return num_blocks
