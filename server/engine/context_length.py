"""The context the engine serves: the model's own (its config.json's), or less.

- `--max-model-len N` (EngineConfig.max_model_len) serves N tokens; more than the model's own is refused
  (GPT-2's learned positions end there; a RoPE model was not trained past it).
- Without it, an explicit KV cache size (--kv-cache-memory, or a block count) must hold one sequence of the
  model's context, or start-up is refused naming both flags (model.kv_cache.kv_cache_blocks).
- Without either, the default KV cache (model.kv_cache.auto_kv_cache_bytes: at most a quarter of the free
  memory) decides: a context it cannot hold once (Llama 3.2's 131,072 tokens) is served as long as it holds,
  with a warning that names --max-model-len.
"""

from __future__ import annotations

import logging

import torch

from model.description import ModelDescription
from model.kv_cache import AUTO_KV_FRACTION, PagedKVCache, available_memory

log = logging.getLogger("kvserve.engine")


def served_config(
    model_config: ModelDescription,
    *,
    max_model_len: int | None,
    kv_cache_sized: bool,
    block_size: int,
    cache_dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> ModelDescription:
    """The model's description with the context it is served at (see the module's docstring).
    `kv_cache_sized`: the KV cache's size was given (--kv-cache-memory or a block count). ValueError naming
    --max-model-len for a context that cannot be served."""
    own = model_config.context_length
    if max_model_len is not None:
        if max_model_len > own:
            raise ValueError(
                f"--max-model-len {max_model_len} is longer than the model's context of {own} tokens "
                f"({model_config.architecture}'s config.json): at most {own}"
            )
        return model_config.with_context_length(max_model_len)
    if kv_cache_sized:
        return model_config
    budget = int(available_memory(device) * AUTO_KV_FRACTION)
    holds = budget // PagedKVCache.bytes_per_block(model_config, block_size, cache_dtype) * block_size
    if holds >= own:
        return model_config
    if holds < block_size:
        raise ValueError(
            f"the default KV cache (a quarter of the {budget / AUTO_KV_FRACTION / 2**20:.0f} MiB free) holds no "
            f"block of {block_size} tokens of this model: set --kv-cache-memory and --max-model-len"
        )
    log.warning(
        "serving a context of %d tokens, not the model's %d: the default KV cache (a quarter of the free memory) "
        "holds no more; --max-model-len and --kv-cache-memory choose otherwise",
        holds,
        own,
    )
    return model_config.with_context_length(holds)
