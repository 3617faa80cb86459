"""The default KV cache size: derived from the model's bytes per token and the memory free at load."""

from __future__ import annotations

import logging

import pytest
import torch

from model import kv_cache
from model.config import GPTConfig
from model.kv_cache import AUTO_KV_FRACTION, AUTO_KV_SEQUENCES, PagedKVCache, auto_kv_cache_bytes, kv_cache_blocks
from model.models import config_from_hf
from model.models.presets import PRESETS

GPT2 = GPTConfig(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def test_bytes_per_token_is_keys_and_values_of_every_layer():
    assert PagedKVCache.bytes_per_token(GPT2, torch.float32) == 12 * 2 * 768 * 4
    assert PagedKVCache.bytes_per_block(GPT2, 16, torch.bfloat16) == 12 * 2 * 768 * 2 * 16


def test_default_holds_32_full_sequences_when_memory_allows(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_memory", lambda device="cpu": 1 << 40)
    per_sequence = 1024 * PagedKVCache.bytes_per_token(GPT2, torch.float32)
    assert auto_kv_cache_bytes(GPT2, torch.float32) == AUTO_KV_SEQUENCES * per_sequence
    blocks = PagedKVCache.blocks_for_memory(GPT2, None, 16, torch.float32)
    assert blocks * 16 == AUTO_KV_SEQUENCES * 1024


def test_default_takes_at_most_its_share_of_free_memory_and_at_least_one_sequence(monkeypatch):
    per_sequence = 1024 * PagedKVCache.bytes_per_token(GPT2, torch.float32)
    monkeypatch.setattr(kv_cache, "available_memory", lambda device="cpu": 10 * per_sequence)
    assert auto_kv_cache_bytes(GPT2, torch.float32) == int(10 * per_sequence * AUTO_KV_FRACTION)
    monkeypatch.setattr(kv_cache, "available_memory", lambda device="cpu": per_sequence)
    assert auto_kv_cache_bytes(GPT2, torch.float32) == per_sequence


def test_an_explicit_size_overrides_the_default():
    assert PagedKVCache.blocks_for_memory(GPT2, 16 * 2**20, 16, torch.float32) == 16 * 2**20 // (16 * 73728)


def test_the_block_count_is_given_or_sized_from_memory_and_must_hold_one_context():
    per_block = PagedKVCache.bytes_per_block(GPT2, 16, torch.float32)
    assert kv_cache_blocks(GPT2, 16, torch.float32, memory_bytes=64 * per_block) == 64
    assert kv_cache_blocks(GPT2, 16, torch.float32, num_blocks=100, memory_bytes=per_block) == 100
    with pytest.raises(ValueError, match=r"holds 63 blocks .* fewer than one 1024-token sequence needs \(64 blocks"):
        kv_cache_blocks(GPT2, 16, torch.float32, memory_bytes=64 * per_block - 1)
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        kv_cache_blocks(GPT2, 16, torch.float32, num_blocks=63)


def test_available_memory_is_positive():
    assert kv_cache.available_memory() > 0


def test_the_cache_logs_the_tokens_it_holds(caplog, tiny_config):
    with caplog.at_level(logging.INFO, logger="kvserve.kv_cache"):
        PagedKVCache(tiny_config, 5, 16)
    assert "80 tokens in all" in caplog.text


SMOLLM2 = config_from_hf(PRESETS["smollm2-135m"])  # 9 query heads, 3 key/value heads of 64, 30 layers


def test_a_grouped_query_model_caches_only_its_key_value_heads():
    """SmolLM2 holds 3 key/value heads of 64 per layer: a third of the bytes of its 9 query heads."""
    assert PagedKVCache.bytes_per_token(SMOLLM2, torch.bfloat16) == 30 * 2 * 3 * 64 * 2
    full_heads = SMOLLM2.replace(num_key_value_heads=9)
    assert PagedKVCache.bytes_per_token(full_heads, torch.bfloat16) == 3 * PagedKVCache.bytes_per_token(
        SMOLLM2, torch.bfloat16
    )
    cache = PagedKVCache(SMOLLM2, 4, 16, dtype=torch.bfloat16)
    assert len(cache.layers) == 30
    assert cache.layers[0].shape == (4, 2, 3, 16 * 64)
    assert cache.total_bytes() == 4 * PagedKVCache.bytes_per_block(SMOLLM2, 16, torch.bfloat16)


def test_a_head_dim_of_its_own_sizes_the_cache_and_the_context_is_max_position_embeddings():
    qwen3 = config_from_hf(PRESETS["qwen3-0.6b"])  # 8 key/value heads of 128 under a hidden size of 1024
    assert PagedKVCache.bytes_per_token(qwen3, torch.float32) == 28 * 2 * 8 * 128 * 4
    per_block = PagedKVCache.bytes_per_block(qwen3, 16, torch.float32)
    with pytest.raises(ValueError, match="fewer than one 40960-token sequence needs"):
        kv_cache_blocks(qwen3, 16, torch.float32, memory_bytes=per_block)
