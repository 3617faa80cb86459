"""The interface every set of inference kernels implements, chosen once per model at load.

`prepare_for_inference` (GPT's, and the decoder families' CausalLM's) builds one backend (exact,
int8 or stock, each in a GPT-2 and a decoder-family variant; a CUDA one would fit the same two calls)
and `forward_step` / `compute_logits` hand each step to it, so no other code asks which kernels run.
"""

from __future__ import annotations

import torch


class KernelBackend:
    """Runs the inference path of one prepared model."""

    name: str  # what /info reports as the model's kernels: 'exact' or 'stock'

    @property
    def kernel_isa(self) -> str | None:
        """The instruction-set path the products run on now ('avx2', 'avx512', 'avx512-bf16',
        'avx512-vnni', 'amx', ...; model.kernels.library.kernel_path), None for torch's kernels."""
        return None

    def forward_step(self, step, cache) -> torch.Tensor:
        """step: model.kv_cache.StepBatch, cache: model.kv_cache.PagedKVCache. Writes every token's keys
        and values to its slot and returns the final hidden states (N, C), before ln_f."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (R, C) rows of forward_step's output. Returns float32 logits (R, V)."""
        raise NotImplementedError
