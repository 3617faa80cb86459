"""The engine's settings (the server's flags of the same names)."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_KV_CACHE_MEMORY = 128 * 2**20  # bytes: the previous engine's 32 slots of 512 tokens, for the default model


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 128  # requests running at once (holding blocks), at most
    max_waiting: int = 128  # requests queued beyond those before new ones get 429
    max_num_batched_tokens: int = 128  # tokens one step computes (decode rows and prompt chunks): a hard cap
    target_step_ms: float | None = None  # prompt chunks sized so a step with decode rows takes about this (None: off)
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory: int | None = None  # bytes of KV cache, all layers (None: model.kv_cache.auto_kv_cache_bytes)
    max_model_len: int | None = None  # tokens a sequence may hold (None: the model's; server/engine/context_length.py)
    num_blocks: int | None = None  # the number of blocks outright (tests); overrides kv_cache_memory
    enable_prefix_caching: bool = True
    threads: int | None = None  # CPU threads of the engine's kernels (None: torch's default, one per core)
    kernels: str = "auto"  # 'exact', 'stock' or 'auto' (model.kernels.kernels_for)
    speculative: str | None = None  # 'ngram': draft by prompt lookup and verify exactly; None: off
    num_speculative_tokens: int = 4  # K, the most draft tokens a request verifies in one step
    prompt_lookup_min: int = 2  # the shortest n-gram a draft is looked up by
    prompt_lookup_max: int = 4  # the longest
    ngram_history: int = 16  # n of the n-gram history shared by requests' drafts (0: each drafts from its own tokens)
    quantization: str | None = None  # None or 'int8': the products' weights (model.kernels.choose_backend)
    kv_cache_dtype: str | None = (
        None  # None (the model's), 'float32', 'bfloat16' or 'int8' (model.kv_cache.resolve_kv_cache_dtype)
    )
    engine_niceness: int = 0  # added to the engine thread's nice value (thread_priority.py); 0: unchanged
    stream_interval_ms: float = 0.0  # an event loop woken at most once per this, bar first and last events (sinks.py)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be 'ngram' or None, got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                f"and {self.prompt_lookup_max}"
            )
        if self.ngram_history < 0:
            raise ValueError(f"ngram_history must be >= 0, got {self.ngram_history}")
        if self.target_step_ms is not None and not self.target_step_ms > 0:
            raise ValueError(f"target_step_ms must be > 0, got {self.target_step_ms}")
        if not 0 <= self.engine_niceness <= 19:
            raise ValueError(f"engine_niceness must be in 0..19, got {self.engine_niceness}")
        if not 0 <= self.stream_interval_ms < math.inf:
            raise ValueError(f"stream_interval_ms must be >= 0, got {self.stream_interval_ms}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


@dataclass(frozen=True)
class EngineInfo:
    """What an engine, or a set of replicas behind one client, tells /info about itself."""

    model_dtype: str  # e.g. float32
    device_type: str  # cpu or cuda
    kernels: str  # exact or stock (what the model runs, resolved from the config's 'auto')
    num_blocks: int  # KV-cache blocks (of one replica, behind the cluster)
    block_size: int  # tokens per block
    config: EngineConfig  # the settings it runs under
    in_process: bool = True  # the model and block pool live in this process (attention weights, the /kv view)
    kernel_isa: str | None = None  # the instruction-set path the products run on (avx2, avx512, avx512-vnni, amx...)
