"""The step through torch's own kernels: on CUDA, for float16 / float64, and on a CPU without the
exact kernels. Same interface and cache layout as the exact ones (model/kernels/exact.py), with a
tolerance instead of bit-identity: torch's products and attention add in orders that depend on the
batch's shape. One backend for GPT-2 (model/gpt.py), one for the Llama-style decoder (model/models)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.kernels.backend import KernelBackend
from model.kernels.interface import EPILOGUE_GELU, EPILOGUE_NONE, EPILOGUE_RESIDUAL


class StockBackend(KernelBackend):
    """The blocks of model/gpt.py op by op (`Block.forward_step`), each op one of this module's."""

    name = "stock"

    def __init__(self, model) -> None:
        self.transformer = model.transformer

    def forward_step(self, step, cache) -> torch.Tensor:
        step = step.trimmed()
        t = self.transformer
        x = F.embedding(step.token_ids, t.wte.weight) + F.embedding(step.positions, t.wpe.weight)  # (N, C)
        for block in t.h:
            block.forward_step(x, step, cache)  # in place
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        return F.linear(t.ln_f(hidden), t.wte.weight).float()  # (R, V)


class DecoderStockBackend(KernelBackend):
    """The Llama-style decoder of model/models/decoder.py op by op (`DecoderModel.forward_step`): the
    reference's own modules, the attention over the paged cache through `grouped_paged_attention`."""

    name = "stock"

    def __init__(self, model) -> None:
        self.model = model

    def forward_step(self, step, cache) -> torch.Tensor:
        return self.model.model.forward_step(step.trimmed(), cache)  # (N, C)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model.model.norm(hidden), self.model.output_weight).float()  # (R, V)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: int = EPILOGUE_NONE,
    residual: torch.Tensor | None = None,
    norm: torch.nn.LayerNorm | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: (N, in), weight: (in, out). norm, epilogue and out as in model.kernels.exact.linear."""
    if norm is not None:
        x = norm(x)
    y = torch.addmm(bias, x, weight) if bias is not None else x @ weight  # (N, out)
    if epilogue == EPILOGUE_GELU:
        y = F.gelu(y, approximate="tanh")
    elif epilogue == EPILOGUE_RESIDUAL:
        y = residual + y
    if out is not None:
        out.copy_(y)
        return out
    return y


def write_cache(
    k: torch.Tensor, v: torch.Tensor, cache_layer: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
) -> None:
    """k, v: (N, nkv, hd) written to their slots in place (keys transposed within a block)."""
    nb, _, nh, _ = cache_layer.shape
    hd = k.shape[-1]
    keys = cache_layer[:, 0].view(nb, nh, hd, block_size)  # (nb, nh, hd, bs)
    values = cache_layer[:, 1].view(nb, nh, block_size, hd)  # (nb, nh, bs, hd)
    block, offset = slot_mapping // block_size, slot_mapping % block_size  # (N,), (N,)
    keys[block, :, :, offset] = k.to(keys.dtype)  # the indexed dims come first: (N, nh, hd)
    values[block, :, offset, :] = v.to(values.dtype)


def paged_attention(qkv: torch.Tensor, cache_layer: torch.Tensor, step, n_head: int, block_size: int) -> torch.Tensor:
    """GPT-2's fused projection: qkv (N, 3C), as many key/value heads as query heads. Returns (N, C)."""
    N, C3 = qkv.shape
    hd = C3 // 3 // n_head
    q, k, v = qkv.view(N, 3, n_head, hd).unbind(1)  # each (N, nh, hd)
    return grouped_paged_attention(q, k, v, cache_layer, step, block_size)  # (N, C)


def grouped_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_layer: torch.Tensor, step, block_size: int
) -> torch.Tensor:
    """Writes the step's keys/values, then gathers each sequence's blocks into one padded batch and
    runs SDPA over it. q: (N, nh, hd); k, v: (N, nkv, hd), nkv dividing nh (query head h reads key/value
    head h // (nh / nkv)); cache_layer: (num_blocks, 2, nkv, bs * hd). Returns (N, nh * hd)."""
    N, n_head, hd = q.shape
    n_kv = k.shape[1]
    write_cache(k, v, cache_layer, step.slot_mapping, block_size)
    S, Q = step.num_seqs, step.max_query_len
    n_blocks = -(-step.max_seq_len // block_size)
    K = n_blocks * block_size
    nb = cache_layer.shape[0]
    tables = step.block_tables[step.seq_rows.long(), :n_blocks].long()  # (S, n_blocks)
    keys = cache_layer[:, 0].view(nb, n_kv, hd, block_size)[tables]  # (S, n_blocks, nkv, hd, bs)
    keys = keys.permute(0, 2, 1, 4, 3).reshape(S, n_kv, K, hd)  # (S, nkv, K, hd)
    values = cache_layer[:, 1].view(nb, n_kv, block_size, hd)[tables]  # (S, n_blocks, nkv, bs, hd)
    values = values.permute(0, 2, 1, 3, 4).reshape(S, n_kv, K, hd)  # (S, nkv, K, hd)
    # token t of sequence s goes to padded row s * Q + (t - query_start[s])
    starts = step.query_start.long()  # (S + 1,)
    seq_of = torch.repeat_interleave(torch.arange(S, device=q.device), starts[1:] - starts[:-1])  # (N,)
    within = torch.arange(N, device=q.device) - starts[seq_of]  # (N,)
    padded_row = seq_of * Q + within  # (N,)
    queries = torch.zeros(S * Q, n_head, hd, dtype=q.dtype, device=q.device)
    queries[padded_row] = q
    queries = queries.view(S, Q, n_head, hd).transpose(1, 2)  # (S, nh, Q, hd)
    visible = padded_visibility(starts, step.seq_lens.long(), Q, K)  # (S, Q, K)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], enable_gqa=n_kv != n_head
    )  # (S, nh, Q, hd)
    return out.transpose(1, 2).reshape(S * Q, n_head * hd)[padded_row]  # (N, nh * hd)


def padded_visibility(query_start: torch.Tensor, seq_lens: torch.Tensor, Q: int, K: int) -> torch.Tensor:
    """(S, Q, K) bool: which keys each padded query row sees. Query j of sequence s sits at position
    seq_len - q_len + j and sees keys 0..position; a padding row (j >= q_len) sees key 0 only, so that
    no row is all -inf (which some fused kernels turn into NaN)."""
    q_len = (query_start[1:] - query_start[:-1])[:, None]  # (S, 1)
    j = torch.arange(Q, device=seq_lens.device)[None]  # (1, Q)
    position = torch.where(j < q_len, seq_lens[:, None] - q_len + j, 0)  # (S, Q)
    return torch.arange(K, device=seq_lens.device)[None, None] <= position[:, :, None]  # (S, Q, K)
