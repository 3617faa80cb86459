"""The GPT-2 network: pre-LayerNorm decoder blocks, learned positions, tied embeddings.

Parameter names and layouts are Hugging Face GPT-2's (`transformer.h.0.attn.c_attn.weight`, linear
weights stored (in, out) as in its Conv1D), so checkpoints map name for name. One `forward` serves
training, uncached recompute, cached prefill and cached decode of ragged batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig
from model.kv_cache import KVCache, check_slot_range


HEAD_BLOCKS = 8  # the inference head sums over C in this many float32 blocks, then adds them in pairs


class Linear(nn.Module):
    """y = x @ W + b with W stored (in, out): GPT-2's Conv1D layout, which `addmm` reads fast."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        # Inference-only copies in column blocks (see split_for_inference); None = plain addmm. Never saved.
        self.register_buffer("split_weight", None, persistent=False)  # (nb, in, out / nb)
        self.register_buffer("split_bias", None, persistent=False)  # (nb, 1, out / nb)

    def split_for_inference(self, blocks: int) -> None:
        """Copies W into `blocks` column blocks, multiplied by one `baddbmm` (one block per thread).

        On the CPU, `addmm` with a few rows (a decode step) runs MKL's one-row kernel on one thread,
        however many there are; a batched product spreads the blocks over the threads. Measured on
        2 cores, side by side: a batch-1 decode step of the default model 1.76 ms, against 2.07 ms
        with `addmm` (BENCHMARKS.md).
        `blocks` < 2 (one thread, or a GPU), or one that does not divide `out`, keeps the plain `addmm`."""
        n_in, n_out = self.weight.shape
        if blocks < 2 or n_out % blocks:
            self.split_weight = self.split_bias = None
            return
        weight, bias = self.weight.detach(), self.bias.detach()
        self.split_weight = weight.view(n_in, blocks, n_out // blocks).transpose(0, 1).contiguous()  # (nb, in, out/nb)
        self.split_bias = bias.view(blocks, 1, n_out // blocks).clone()  # (nb, 1, out/nb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        if self.split_weight is None or self.training:
            out = torch.addmm(self.bias, rows, self.weight)  # (N, out)
        else:
            nb = self.split_weight.shape[0]
            out = torch.baddbmm(self.split_bias, rows.expand(nb, -1, -1), self.split_weight)  # (nb, N, out/nb)
            out = out.transpose(0, 1).reshape(rows.shape[0], -1)  # (N, out)
        return out.view(*x.shape[:-1], -1)


def pairwise_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts: (nb, ...). Their sum over nb, added in pairs (first half + second half, again and
    again): each result is rounded about log2(nb) times, where a running sum rounds it nb - 1 times."""
    while parts.shape[0] > 1:
        n, half = parts.shape[0], parts.shape[0] // 2
        paired = parts[:half] + parts[half: 2 * half]  # (n // 2, ...)
        parts = paired if n % 2 == 0 else torch.cat([paired, parts[2 * half:]])  # an odd one waits a round
    return parts[0]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere: built once per forward, where a bool mask would be converted
    to this again by every layer's attention."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


@dataclass
class AttentionBatch:
    """What every layer needs to attend for one forward; built once per forward, shared by layers."""

    mask: torch.Tensor | None  # (B, 1, T, K) additive, 0 = may attend, -inf = may not; None = plain causal
    cache: KVCache | None  # where keys/values live across steps; None = recompute
    slots: torch.Tensor | None  # (B,) cache slot per row, read with a gather; None = the range below
    first_slot: int  # with slots None, rows use slots first_slot .. first_slot + B - 1, read as a view
    rows: torch.Tensor | None  # (B, 1) the same slots as a tensor, for the in-place writes
    write_pos: torch.Tensor | None  # (B, T) cache column each token writes (padding -> scratch)
    kv_len: int  # cache columns attended over (K)
    attention_out: list[torch.Tensor] | None = None  # when a list, each layer appends its weights (B, nh, T, K)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)  # fused q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, nh, hs)
        q = qkv[:, :, 0].transpose(1, 2)  # (B, nh, T, hs)
        if batch.cache is None:
            k, v = qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)  # (B, nh, T, hs)
        else:
            k, v = self._write_and_read_cache(qkv[:, :, 1:], batch)  # (B, nh, K, hs)
        if batch.attention_out is not None:
            y = self._explicit_attention(q, k, v, batch)  # (B, nh, T, hs)
        else:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=batch.mask, dropout_p=drop, is_causal=batch.mask is None
            )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def _explicit_attention(self, q, k, v, batch: AttentionBatch) -> torch.Tensor:
        """Softmax spelled out so the weights can be returned (the fused kernels do not expose them)."""
        T, K = q.shape[-2], k.shape[-2]
        mask = batch.mask
        if mask is None:
            visible = torch.ones(T, K, dtype=torch.bool, device=q.device).tril(K - T)  # (T, K) plain causal
            mask = additive_mask(visible, q.dtype)  # (T, K)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, nh, T, K)
        scores = scores.masked_fill(mask.isneginf(), float("-inf"))  # a masked column counts for nothing, NaN or not
        weights = scores.softmax(dim=-1).nan_to_num(0.0)  # (B, nh, T, K)
        batch.attention_out.append(weights)
        return weights @ v  # (B, nh, T, hs)

    def _write_and_read_cache(self, kv: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """kv: (B, T, 2, nh, hs), this step's keys and values. Returns each row's (B, nh, K, hs) keys, values."""
        kv_cache = batch.cache.layers[self.layer_idx]  # (S, 2, nh, max_len + 1, hs)
        kv_cache[batch.rows, :, :, batch.write_pos] = kv  # in place at each row's own positions, keys and values
        if batch.slots is None:
            kv = kv_cache.narrow(0, batch.first_slot, kv.shape[0])[:, :, :, : batch.kv_len]  # (B, 2, nh, K, hs), a view
        else:
            kv = kv_cache[batch.slots, :, :, : batch.kv_len]  # (B, 2, nh, K, hs), a gather of the K columns only
        return kv[:, 0], kv[:, 1]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), batch)
        return x + self.mlp(self.ln_2(x))


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
        # (HEAD_BLOCKS, C / HEAD_BLOCKS, V) copy of the tied embedding for inference: see
        # prepare_for_inference. Never saved.
        self.register_buffer("head_blocks", None, persistent=False)
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

    def prepare_for_inference(self, threads: int | None = None) -> "GPT":
        """Eval mode plus the inference-only weight copies; call again after changing the weights, the
        dtype, or the number of CPU threads the model will run on (`threads`, default torch's).

        On the CPU with several threads, every Linear keeps its weight in one column block per thread
        (see Linear.split_for_inference).

        The head multiplies by a contiguous copy of the embedding, (C, V) split along C into
        HEAD_BLOCKS blocks (which `x @ w` reads faster than F.linear reads (V, C) on the CPU); half-
        precision models keep it in float32. Its logits are large (|logit| ~ 15), so one float32
        reduction over all of C rounds each of them by up to ~1e-5, differently for inputs that differ
        in the last bit and in the one-row kernel a decode step uses than in a many-row one. Summing
        C / HEAD_BLOCKS products per block, then the blocks in pairs (3 roundings of the large sum, not
        C - 1), keeps cached and uncached logits within 1e-5 of each other: measured on the default
        model over 480 steps of random tokens, at most 7.2e-6 (6.7e-6 when the blocks were added in
        float64, which cost a batch-32 step ~0.8 ms more), and 4.8e-6 in the cache-identity test.
        """
        self.eval()
        weight = self.transformer.wte.weight.detach()
        head_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        V, C = weight.shape
        nb = HEAD_BLOCKS if C % HEAD_BLOCKS == 0 else 1
        self.head_blocks = weight.t().to(head_dtype).contiguous().view(nb, C // nb, V)  # (nb, C/nb, V)
        threads = threads or torch.get_num_threads()
        for module in self.modules():
            if isinstance(module, Linear):
                module.split_for_inference(threads if weight.device.type == "cpu" else 1)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        slots: torch.Tensor | slice | int | None = None,
        kv_len: int | None = None,
        logits_index: torch.Tensor | None = None,
        attention_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits for a batch of token ids.

        input_ids: (B, T). positions: (B, T), each token's position in its own sequence, -1 for
        padding; None means 0..T-1 for every row (training, plain causal). With `cache`, keys and
        values are written to `slots` at `positions` and attention reads the first `kv_len`
        columns of each slot (default: the whole cache). slots: (B,) slot per row, or a range of B
        contiguous slots (read as a view): a slice, or an int, its first slot; None = 0..B-1.
        logits_index: (B,) index along T of the one token per row whose logits are wanted; returns
        (B, V) then, else (B, T, V).
        attention_out: a list that receives each layer's attention weights (B, nh, T, K), computed
        with an explicit softmax; leave None for the fast fused kernels.
        """
        B, T = input_ids.shape
        batch = self._attention_batch(input_ids, positions, cache, slots, kv_len)
        batch.attention_out = attention_out
        pos = positions.clamp(min=0) if positions is not None else torch.arange(T, device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, batch)
        if logits_index is not None and T == 1:
            x = x[:, 0]  # (B, C): a decode step, no gather needed
        elif logits_index is not None:
            x = x[torch.arange(B, device=x.device), logits_index]  # (B, C)
        x = self.transformer.ln_f(x)
        if self.head_blocks is not None and not self.training:
            return self._blocked_head(x)  # (B, [T,] V)
        return F.linear(x, self.transformer.wte.weight)  # (B, [T,] V), tied head

    def _blocked_head(self, x: torch.Tensor, rows_per_call: int = 256) -> torch.Tensor:
        """Tied-head logits from float32 sums over blocks of C, added in pairs (see prepare_for_inference).
        x: (..., C). Rows go through in groups of `rows_per_call`, which bounds the (nb, n, V) partials."""
        nb, block, V = self.head_blocks.shape
        rows = x.reshape(-1, nb * block).to(self.head_blocks.dtype)  # (N, C)
        logits = [pairwise_sum(torch.bmm(part.view(-1, nb, block).transpose(0, 1), self.head_blocks))  # (n, V)
                  .to(x.dtype) for part in rows.split(rows_per_call)]
        out = logits[0] if len(logits) == 1 else torch.cat(logits)  # (N, V)
        return out.view(*x.shape[:-1], V)

    def _attention_batch(self, input_ids, positions, cache, slots, kv_len) -> AttentionBatch:
        B, T = input_ids.shape
        if positions is None:
            if cache is not None:
                raise ValueError("a cached forward needs explicit positions")
            if T > self.config.n_positions:
                raise ValueError(f"sequence length {T} exceeds the context {self.config.n_positions}")
            return AttentionBatch(mask=None, cache=None, slots=None, first_slot=0, rows=None, write_pos=None,
                                  kv_len=T)
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match input_ids {tuple(input_ids.shape)}")
        valid = positions >= 0  # (B, T)
        dtype = self.transformer.wte.weight.dtype
        if cache is None:
            visible = positions[:, None, :] <= positions[:, :, None]  # (B, T_q, T_k)
            mask = visible & valid[:, None, :] & valid[:, :, None]  # (B, T, T)
            return AttentionBatch(mask=additive_mask(mask[:, None], dtype), cache=None, slots=None, first_slot=0,
                                  rows=None, write_pos=None, kv_len=T)
        kv_len = cache.max_len if kv_len is None else kv_len
        columns = cache.columns[:kv_len]  # (K,)
        mask = columns[None, None, :] <= positions[:, :, None]  # (B, T, K); padding (-1) sees nothing
        write_pos = torch.where(valid, positions, cache.scratch_column)  # (B, T)
        if isinstance(slots, torch.Tensor):
            rows, first_slot = slots, 0  # (B,)
        else:  # a range: a slice, its first slot as an int (what a compiled step passes), or None for 0..B-1
            if isinstance(slots, slice):
                check_slot_range(slots, B)
                slots = slots.start
            first_slot = 0 if slots is None else slots
            rows, slots = torch.arange(first_slot, first_slot + B, device=positions.device), None  # (B,)
        return AttentionBatch(mask=additive_mask(mask[:, None], dtype), cache=cache, slots=slots,
                              first_slot=first_slot, rows=rows[:, None], write_pos=write_pos, kv_len=kv_len)
