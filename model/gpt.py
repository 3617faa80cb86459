"""The GPT-2 network: pre-LayerNorm decoder blocks, learned positions, tied embeddings.

Parameter names and layouts are Hugging Face GPT-2's (`transformer.h.0.attn.c_attn.weight`, linear
weights stored (in, out) as in its Conv1D), so checkpoints map name for name.

Two forwards over the same parameters:
- `forward(input_ids)`: a (B, T) batch, plain causal, no cache, torch's kernels. Training, and the
  independent reference the tests compare the inference path against.
- `forward_step(step, cache)` then `compute_logits(hidden)`: inference. One flattened batch of N new
  tokens from any mix of sequences (prefill chunks, decode rows, whole recomputes), each token with
  its own position and cache slot, attending over its sequence's blocks in the paged KV cache. Every
  linear layer runs once over all N tokens, through the kernel backend `prepare_for_inference` chose
  (model/kernels: the exact C++ kernels in one call, or torch's op by op through the `forward_step`
  methods below).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import kernels
from model.config import GPTConfig
from model.kernels import EPILOGUE_GELU, EPILOGUE_NONE, EPILOGUE_RESIDUAL, KernelBackend, StockBackend
from model.kv_cache import PagedKVCache, StepBatch


class Linear(nn.Module):
    """y = x @ W + b with W stored (in, out): GPT-2's Conv1D layout."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)

    def infer(
        self,
        x: torch.Tensor,
        epilogue: int = EPILOGUE_NONE,
        residual: torch.Tensor | None = None,
        *,
        norm: nn.LayerNorm | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (N, in). Returns epilogue(norm(x) @ W + b): (N, out), written to `out` if given (which may
        be `residual`: x += ...), through torch's kernels (the stock backend's step)."""
        return kernels.stock.linear(x, self.weight, self.bias, epilogue, residual, norm, out)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)  # fused q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attention_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hs)
        if attention_out is not None:
            y = self._explicit_attention(q, k, v, attention_out)  # (B, nh, T, hs)
        else:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    @staticmethod
    def _explicit_attention(q, k, v, attention_out: list[torch.Tensor]) -> torch.Tensor:
        """Softmax spelled out so the weights can be returned (the fused kernels do not expose them)."""
        T = q.shape[-2]
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # (T, T)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, nh, T, T)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)  # (B, nh, T, T)
        attention_out.append(weights)
        return weights @ v  # (B, nh, T, hs)

    def forward_step(self, x: torch.Tensor, norm: nn.LayerNorm, step: StepBatch, cache: PagedKVCache) -> None:
        """x: (N, C), the residual stream: x += attention(norm(x)), in place."""
        qkv = self.c_attn.infer(x, norm=norm)  # (N, 3C)
        layer = cache.layers[self.layer_idx]  # (num_blocks, 2, nh, bs * hs)
        y = kernels.stock.paged_attention(qkv, layer, step, self.n_head, cache.block_size)  # (N, C)
        self.c_proj.infer(y, EPILOGUE_RESIDUAL, x, out=x)  # (N, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))

    def forward_step(self, x: torch.Tensor, norm: nn.LayerNorm) -> None:
        """x: (N, C), the residual stream: x += mlp(norm(x)), in place."""
        h = self.c_fc.infer(x, EPILOGUE_GELU, norm=norm)  # (N, 4C)
        self.c_proj.infer(h, EPILOGUE_RESIDUAL, x, out=x)  # (N, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attention_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_out)
        return x + self.mlp(self.ln_2(x))

    def forward_step(self, x: torch.Tensor, step: StepBatch, cache: PagedKVCache) -> None:
        """x: (N, C), updated in place; each layer norm runs inside the product that follows it."""
        self.attn.forward_step(x, self.ln_1, step, cache)
        self.mlp.forward_step(x, self.ln_2)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        self.backend: KernelBackend = StockBackend(self)  # the inference path's kernels (prepare_for_inference)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, Linear):
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    @property
    def kernels(self) -> str:
        """The name of the backend the inference path runs: 'exact' or 'stock'."""
        return self.backend.name

    @property
    def kernel_isa(self) -> str | None:
        """The instruction-set path its products run on ('avx2', 'avx512', 'avx512-vnni', 'amx', ...),
        None on torch's kernels."""
        return self.backend.kernel_isa

    @property
    def quantization(self) -> str | None:
        """How the inference path's product weights are stored: None (the model's dtype) or 'int8'."""
        return getattr(self.backend, "quantization", None)

    def prepare_for_inference(self, kernels_name: str = "auto", quantization: str | None = None) -> GPT:
        """Eval mode, and the inference path's kernel backend, chosen once: 'auto' (exact where they
        run: model.kernels.kernels_for), 'exact' or 'stock'; quantization='int8' for int8 weights (made
        here from the float32 ones). The exact kernels read weights packed once here; call again after
        changing the weights, the dtype or the device."""
        self.eval()
        self.backend = kernels.choose_backend(self, kernels_name, quantization)
        return self

    def forward(self, input_ids: torch.Tensor, attention_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids: (B, T), plain causal from position 0. Returns logits (B, T, V).
        attention_out: a list that receives each layer's attention weights (B, nh, T, T), computed
        with an explicit softmax; leave None for the fused kernels."""
        B, T = input_ids.shape
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds the context {self.config.n_positions}")
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, attention_out)
        return F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)  # (B, T, V), tied head

    @torch.inference_mode()
    def forward_step(self, step: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """The flattened step: writes every token's keys/values to its slot and returns the final
        hidden states (N, C), before ln_f; `compute_logits` turns the rows that sample into logits."""
        return self.backend.forward_step(step, cache)  # (N, C)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (R, C) rows of forward_step's output. Returns float32 logits (R, V)."""
        return self.backend.compute_logits(hidden)  # (R, V)
