"""The Llama-style decoder that Llama, Qwen2 and Qwen3 share: pre-RMSNorm blocks of grouped-query attention
with RoPE and a SwiGLU MLP, a final RMSNorm, an output head that is the embedding matrix or its own.

Module names are the checkpoints' own (`model.layers.0.self_attn.q_proj.weight`, `model.embed_tokens.weight`,
`lm_head.weight`), so weights load name for name. Every difference between the families is a field of
ModelConfig (biases, QK-norm, head_dim, RoPE, tied head), never a branch on the family.

Two forwards over the same parameters, as model/gpt.py has:
- `forward(input_ids)`: a (B, T) batch with plain causal attention and no cache: the reference that the
  inference path is compared against, and what the parity tests compare with transformers.
- `prepare_for_inference(kernels_name, quantization)`, then `forward_step(step, cache)` and
  `compute_logits(hidden)`: inference over the paged KV cache, one flattened batch of N tokens from any
  mix of sequences, through the kernel backend chosen once (model/kernels: the exact C++ step, or
  torch's ops through the `forward_step` methods below). The interface GPT has, with the same names.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import kernels
from model.kernels import DecoderStockBackend, KernelBackend
from model.kv_cache import PagedKVCache, StepBatch
from model.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from model.models.config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C), cos/sin: (B, T, hd) or (T, hd) -> (B, T, C)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, C)

    def forward_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepBatch, layer: torch.Tensor, bs: int
    ) -> torch.Tensor:
        """x: (N, C) the step's tokens, cos/sin: (N, hd) at their positions, layer: this layer's cache
        (num_blocks, 2, nkv, bs * hd), written with the step's rotated keys and its values. Returns (N, C)."""
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)  # (N, nh, hd), (N, nkv, hd) x2
        y = kernels.stock.grouped_paged_attention(q, k, v, layer, step, bs)  # (N, nh * hd)
        x = x + self.self_attn.o_proj(y)  # (N, C)
        return x + self.mlp(self.post_attention_layernorm(x))  # (N, C)


class DecoderModel(nn.Module):
    """The checkpoint's `model.` prefix: embeddings, layers, final norm (and the computed RoPE tables)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, T); positions: (B, T) or (T,), 0..T-1 if not given. Returns (B, T, C) after the final norm."""
        x = self.embed_tokens(input_ids)  # (B, T, C)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        cos, sin = self.rotary_emb(positions, x.dtype)  # each (B, T, hd) or (T, hd), shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, C)
        return self.norm(x)  # (B, T, C)

    def forward_step(self, step: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """The stock backend's step (step trimmed to its sizes): the final hidden states (N, C), before the
        final norm."""
        x = self.embed_tokens(step.token_ids)  # (N, C)
        cos, sin = self.rotary_emb(step.positions, x.dtype)  # each (N, hd)
        for layer, cache_layer in zip(self.layers, cache.layers):
            x = layer.forward_step(x, cos, sin, step, cache_layer, cache.block_size)  # (N, C)
        return x


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # a tied head has no parameter of its own (and no lm_head.weight in the checkpoint)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.backend: KernelBackend = DecoderStockBackend(self)  # the inference path's kernels (prepare_for_inference)

    @property
    def output_weight(self) -> torch.Tensor:
        """The head's (vocab, C) matrix: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, T) -> logits (B, T, vocab)."""
        return F.linear(self.model(input_ids, positions), self.output_weight)  # (B, T, V)

    # ---- inference: the interface model/gpt.py's GPT has ------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def kernels(self) -> str:
        """The name of the backend the inference path runs: 'exact' or 'stock'."""
        return self.backend.name

    @property
    def kernel_isa(self) -> str | None:
        """The instruction-set path its products run on ('avx2', 'avx512', 'avx512-vnni', ...), None on
        torch's kernels."""
        return self.backend.kernel_isa

    @property
    def quantization(self) -> str | None:
        """How the inference path's product weights are stored: None (the model's dtype) or 'int8'."""
        return getattr(self.backend, "quantization", None)

    def prepare_for_inference(self, kernels_name: str = "auto", quantization: str | None = None) -> CausalLM:
        """Eval mode, and the inference path's kernel backend, chosen once: 'auto' (exact where they run:
        model.kernels.kernels_for), 'exact' or 'stock'; quantization='int8' for int8 weights (made here from
        the float32 ones). The exact kernels read weights packed once here; call again after changing the
        weights, the dtype or the device."""
        self.eval()
        self.backend = kernels.choose_backend(self, kernels_name, quantization)
        return self

    @torch.inference_mode()
    def forward_step(self, step: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """The flattened step: writes every token's rotated keys and its values to its slot and returns the
        final hidden states (N, C), before the final norm; `compute_logits` turns the rows that sample into
        logits."""
        return self.backend.forward_step(step, cache)  # (N, C)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (R, C) rows of forward_step's output. Returns float32 logits (R, V): the final norm, then
        the head."""
        return self.backend.compute_logits(hidden)  # (R, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
