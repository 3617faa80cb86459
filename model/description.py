"""What everything around the network reads of a model, whatever its architecture.

`ModelDescription`: the one description the engine, the KV cache, the HTTP layer and the tools size and
check things by. GPT-2's config (model.config.GPTConfig) and the Llama/Qwen families' (model.models.config.
ModelConfig) each provide it as properties over their own fields, so no caller asks which architecture it holds.

`InferenceModel`: what the engine calls on the network (model.gpt.GPT, model.models.CausalLM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Self

import torch

if TYPE_CHECKING:
    from model.kv_cache import PagedKVCache, StepBatch


class ModelDescription(Protocol):
    @property
    def architecture(self) -> str:
        """config.json's `architectures` entry that runs it, e.g. GPT2LMHeadModel, Qwen3ForCausalLM."""

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding and of the logits: every id the model can read or sample (Qwen's are more
        than its tokenizer's)."""

    @property
    def context_length(self) -> int:
        """Tokens one sequence may hold, prompt and generated: the model's own, or less where
        `with_context_length` capped it (--max-model-len)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int:
        """Query heads per layer."""

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer: what the KV cache stores (fewer than num_heads under grouped-query
        attention)."""

    @property
    def head_dim(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None:
        """config.json's bos_token_id (None where it names none)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """config.json's eos_token_id: none, one or several ids (generation_config.json may add more:
        model.checkpoint.eos_token_ids)."""

    def with_context_length(self, context_length: int) -> Self:
        """The same model served with a shorter context; ConfigError for a longer one than the model's."""


class InferenceModel(Protocol):
    """A network as the engine runs it (model.gpt.GPT, model.models.CausalLM), loaded by
    model.checkpoint.load_model: the flattened step over the paged KV cache, then the logits of its rows."""

    config: ModelDescription

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def kernels(self) -> str:
        """The backend the step runs: 'exact' or 'stock'."""

    @property
    def kernel_isa(self) -> str | None:
        """The instruction-set path of the exact kernels' products; None on torch's."""

    @property
    def quantization(self) -> str | None:
        """None (the model's dtype) or 'int8'."""

    def prepare_for_inference(self, kernels_name: str = "auto", quantization: str | None = None) -> Self:
        """Eval mode and the kernel backend, chosen once ('auto', 'exact' or 'stock')."""

    def forward_step(self, step: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """Writes the step's keys and values to their cache slots; returns the final hidden states (N, C)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (R, C) rows of forward_step's output -> float32 logits (R, V)."""
