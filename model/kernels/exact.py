"""The exact kernels' ops (csrc/), and the backend that runs a whole step through them.

Every output element is reduced in one fixed order that depends only on the length of the
reduction, so a token's logits do not depend on how many rows share its step, where its row sits,
whether its keys came from a prefix-cache hit, or whether it was decoded or recomputed.
"""

from __future__ import annotations

import ctypes
import functools
import math
import weakref
from dataclasses import dataclass

import torch

from model.kernels.arena import WeightArena
from model.kernels.backend import KernelBackend
from model.kernels.interface import (
    DTYPE_BF16,
    DTYPE_BF16_F32,
    DTYPE_F32,
    DTYPE_I8,
    EPILOGUE_NONE,
    EPILOGUE_SILU_MUL,
    FEATURE_AVX512BF16,
    NORM_LAYER,
    NORM_RMS,
    STRUCTS,
    WEIGHT_BF16,
    WEIGHT_BF16_PAIRS,
    WEIGHT_F32,
)
from model.kernels.library import handle, kernel_path
from model.kv_cache import SCALE_BYTES

GROUP = 64  # output columns per packed weight group: one task of csrc/linear.cpp
STRIP = 16  # output columns per strip of a group, each stored k-major
EXACT_HEAD_DIMS = (8, 16, 32, 64, 128)
_DTYPE_CODE = {torch.float32: DTYPE_F32, torch.bfloat16: DTYPE_BF16, torch.int8: DTYPE_I8}  # int8: a KV cache only
_WEIGHT_FORMAT = {torch.float32: WEIGHT_F32, torch.bfloat16: WEIGHT_BF16}


def bf16_pairs_available() -> bool:
    """Whether bfloat16 products may use AVX512-BF16 (vdpbf16ps) now; else they widen to float32."""
    lib = handle()
    return lib is not None and bool(lib.kv_features() & FEATURE_AVX512BF16)


def exact_attention_supported(head_dim: int, block_size: int) -> bool:
    return head_dim in EXACT_HEAD_DIMS and block_size % 8 == 0


@dataclass
class PackedWeight:
    """A linear layer's (in, out) weight packed for csrc/linear.cpp: (groups, 4, in, 16), strips of 16
    columns each stored k-major, zero past `n_out`, with its bias in float32 (zeros where the layer has
    none), padded to the groups. int8 weights (model/kernels/int8.py) add per-column scales and offsets."""

    weight: torch.Tensor  # (groups, GROUP // STRIP, n_in, STRIP); int8: (groups, 4, n_in / 4, STRIP, 4)
    bias: torch.Tensor  # (groups * GROUP,) float32
    n_in: int
    n_out: int
    format: int = WEIGHT_F32  # interface.WEIGHT_*: how `weight` is laid out
    scale: torch.Tensor | None = None  # int8: (groups * GROUP,) float32, each column's scale
    offset: torch.Tensor | None = None  # int8: (groups * GROUP,) int32, 128 times each column's sum

    def __post_init__(self) -> None:
        self.struct = STRUCTS["kv_weight"](
            self.format,
            self.n_in,
            self.n_out,
            self.weight.data_ptr(),
            self.bias.data_ptr(),
            self.scale.data_ptr() if self.scale is not None else None,
            self.offset.data_ptr() if self.offset is not None else None,
        )

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """weight: (in, out), GPT-2's Conv1D layout (for the tied head, the embedding transposed).
        bfloat16 weights go in pairs of k (WEIGHT_BF16_PAIRS) where the kernels may use AVX512-BF16."""
        n_in, n_out = weight.shape
        groups = -(-n_out // GROUP)
        b = torch.zeros(groups * GROUP, dtype=torch.float32, device=weight.device)
        if bias is not None:
            b[:n_out] = bias.detach().float()
        if weight.dtype == torch.bfloat16 and bf16_pairs_available():
            pairs = -(-n_in // 2)
            padded = torch.zeros(pairs * 2, groups * GROUP, dtype=weight.dtype, device=weight.device)
            padded[:n_in, :n_out] = weight.detach()
            strips = padded.view(pairs, 2, groups, GROUP // STRIP, STRIP)  # (pairs, 2, groups, 4, STRIP)
            packed = strips.permute(2, 3, 0, 4, 1)  # (groups, 4, pairs, STRIP, 2)
            return cls(packed.contiguous(), b, n_in, n_out, WEIGHT_BF16_PAIRS)
        padded = torch.zeros(n_in, groups * GROUP, dtype=weight.dtype, device=weight.device)  # (in, out padded)
        padded[:, :n_out] = weight.detach()
        strips = padded.view(n_in, groups, GROUP // STRIP, STRIP).permute(1, 2, 0, 3)  # (groups, 4, in, STRIP)
        return cls(strips.contiguous(), b, n_in, n_out, _WEIGHT_FORMAT[weight.dtype])

    @property
    def nbytes(self) -> int:
        """The bytes a product reads for this weight: the weight, its bias, scales and offsets."""
        parts = [t for t in (self.weight, self.bias, self.scale, self.offset) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass
class PackedNorm:
    """A norm's parameters in float32 for the linear kernel's prologue: a LayerNorm's weight and bias
    (2, C), or an RMSNorm's weight (1, C) (model/layers/rms_norm.py)."""

    params: torch.Tensor  # (2, C) float32: weight, bias; or (1, C): weight
    eps: float
    kind: int = NORM_LAYER  # interface.NORM_LAYER or NORM_RMS

    @classmethod
    def pack(cls, norm: torch.nn.Module) -> PackedNorm:
        """A torch.nn.LayerNorm, or an RMSNorm (a weight and an eps, no bias)."""
        if isinstance(norm, torch.nn.LayerNorm):
            params = torch.stack([norm.weight.detach().float(), norm.bias.detach().float()])
            return cls(params.contiguous(), norm.eps)
        return cls(norm.weight.detach().float().reshape(1, -1).contiguous(), norm.eps, NORM_RMS)

    @property
    def weight(self) -> int:
        """The address of the float32 weight."""
        return self.params.data_ptr()

    @property
    def bias(self) -> int | None:
        """The address of the float32 bias (a layer norm's), else None."""
        return self.params[1].data_ptr() if self.kind == NORM_LAYER else None


def linear(
    x: torch.Tensor,
    w: PackedWeight,
    epilogue: int = EPILOGUE_NONE,
    residual: torch.Tensor | None = None,
    *,
    norm: PackedNorm | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """epilogue(norm(x) @ W + b) through csrc/linear.cpp. x: (N, in) contiguous, in the weights' dtype
    (float32 for int8 weights).
    norm: a layer norm or an RMSNorm applied to each row of x first. epilogue: EPILOGUE_NONE,
    EPILOGUE_GELU (tanh GELU), EPILOGUE_RESIDUAL (residual + (x @ W + b)) or EPILOGUE_SILU_MUL (SwiGLU
    over a product packed by pack_gate_up: (N, out / 2)). out: where to write (N, out); it may be
    `residual` itself. Returns (N, out) in x's dtype, or float32 with out_dtype=torch.float32
    (bfloat16 models' logits)."""
    out_dtype = out_dtype or x.dtype
    code = _DTYPE_CODE[x.dtype] if out_dtype == x.dtype else DTYPE_BF16_F32
    if code == DTYPE_BF16_F32 and (x.dtype, out_dtype) != (torch.bfloat16, torch.float32):
        raise TypeError(f"linear: activations {x.dtype}, weights {w.weight.dtype}, output {out_dtype}")
    rows = x.shape[0]
    cols = w.n_out // 2 if epilogue == EPILOGUE_SILU_MUL else w.n_out
    y = torch.empty((rows, cols), dtype=out_dtype, device=x.device) if out is None else out
    failed = handle().kv_linear(
        ctypes.byref(w.struct),
        code,
        x.contiguous().data_ptr(),
        rows,
        y.data_ptr(),
        epilogue,
        residual.data_ptr() if residual is not None else None,
        norm.kind if norm is not None else NORM_LAYER,
        norm.weight if norm is not None else None,
        norm.bias if norm is not None else None,
        norm.eps if norm is not None else 0.0,
    )
    if failed:
        raise TypeError(f"linear: activations {x.dtype} and weights of format {w.format} do not go together here")
    return y


def embed(
    token_ids: torch.Tensor, positions: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor | None
) -> torch.Tensor:
    """wte[token_ids] + wpe[positions], or wte[token_ids] without wpe: (N, C), through csrc/embedding.cpp."""
    n, C = token_ids.shape[0], wte.shape[1]
    out = torch.empty((n, C), dtype=wte.dtype, device=wte.device)
    handle().kv_embed(
        _DTYPE_CODE[wte.dtype],
        token_ids.data_ptr(),
        positions.data_ptr(),
        n,
        wte.data_ptr(),
        wpe.data_ptr() if wpe is not None else None,
        C,
        out.data_ptr(),
    )
    return out


def greedy(logits: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Per row of float32 (R, V) logits: out (R, >= 3) float64 gets the first index of the largest logit,
    its logprob and 1 if the row is finite; lse (R,) float32 gets log(sum(exp)). Each row in one fixed
    order (csrc/sampling.cpp)."""
    handle().kv_greedy(
        logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), out.stride(0), lse.data_ptr()
    )


def greedy_masked(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """After `greedy`: the rows `rows` (c,) int64 picked again among the tokens their grammar allows, bitmask
    (c, words) int32 (bit j % 32 of word j / 32: token j); out and lse as `greedy` left them (csrc/sampling.cpp)."""
    rows, bitmask = rows.contiguous(), bitmask.contiguous()
    handle().kv_greedy_masked(
        logits.data_ptr(),
        logits.shape[1],
        rows.data_ptr(),
        rows.shape[0],
        bitmask.data_ptr(),
        bitmask.shape[1],
        out.data_ptr(),
        out.stride(0),
        lse.data_ptr(),
    )


def paged_attention(qkv: torch.Tensor, cache_layer: torch.Tensor, step, n_head: int, block_size: int) -> torch.Tensor:
    """Writes each token's keys/values to its slot, then attends over its sequence's blocks, through
    csrc/attention.cpp. cache_layer: (num_blocks, 2, nkv, bs * hd), whose shape gives the key/value heads
    and head_dim; qkv: (N, (nh + 2 nkv) * hd) contiguous, the query heads, the key heads, the value heads
    (GPT-2's (N, 3C)); query head h reads key/value head h // (nh / nkv).
    step: model.kv_cache.StepBatch. The cache holds qkv's dtype, bfloat16 under float32, or int8 (each head's
    block then followed by its scales: (num_blocks, 2, nkv, bs * (hd + SCALE_BYTES))). Returns (N, nh * hd)."""
    N = qkv.shape[0]  # N == step.num_tokens
    n_kv, head_dim = cache_layer.shape[2], cache_layer.shape[3] // block_size
    if cache_layer.dtype == torch.int8:
        head_dim -= SCALE_BYTES
    out = torch.empty((N, n_head * head_dim), dtype=qkv.dtype, device=qkv.device)
    failed = handle().kv_paged_attention(
        _DTYPE_CODE[qkv.dtype],
        _DTYPE_CODE[cache_layer.dtype],
        qkv.data_ptr(),
        N,
        n_head,
        n_kv,
        head_dim,
        cache_layer.data_ptr(),
        block_size,
        step.slot_mapping.data_ptr(),
        step.num_seqs,
        step.query_start.data_ptr(),
        step.seq_lens.data_ptr(),
        step.block_tables.data_ptr(),
        step.block_tables.stride(0),
        step.seq_rows.data_ptr(),
        1.0 / math.sqrt(head_dim),
        out.data_ptr(),
    )
    if failed:
        raise ValueError(
            f"paged_attention: activations {qkv.dtype} over a {cache_layer.dtype} cache, head_dim "
            f"{head_dim}, {n_head} query heads over {n_kv} key/value heads, block size {block_size}: not a "
            f"combination the kernels have"
        )
    return out


def rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    n_head: int,
    n_kv_head: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """In place on qkv (N, (nh + 2 nkv) * hd) contiguous: QK-norm (RMSNorm of each query and key head by the
    float32 weights q_norm, k_norm (hd,), where given), then rotate-half RoPE at each token's position
    (int64 (N,)) from the float32 table (positions, hd) of rope_table, through csrc/rope.cpp."""
    hd = table.shape[1]
    failed = handle().kv_rope(
        _DTYPE_CODE[qkv.dtype],
        qkv.data_ptr(),
        qkv.shape[0],
        n_head,
        n_kv_head,
        hd,
        positions.data_ptr(),
        table.data_ptr(),
        table.shape[0],
        q_norm.data_ptr() if q_norm is not None else None,
        k_norm.data_ptr() if k_norm is not None else None,
        eps,
    )
    if failed:
        raise ValueError(f"rope: a position outside the table's {table.shape[0]}, or an odd head_dim {hd}")


def step_arguments(step) -> tuple:
    """A StepBatch as the whole-step kernels (kv_forward, kv_decoder_forward) read it, from token_ids to
    seq_rows."""
    return (
        step.token_ids.data_ptr(),
        step.positions.data_ptr(),
        step.num_tokens,
        step.slot_mapping.data_ptr(),
        step.num_seqs,
        step.query_start.data_ptr(),
        step.seq_lens.data_ptr(),
        step.block_tables.data_ptr(),
        step.block_tables.stride(0),
        step.seq_rows.data_ptr(),
    )


class ExactBackend(KernelBackend):
    """The step through csrc/forward.cpp in one call (the blocks of model/gpt.py, op for op), and the
    tied head through csrc/linear.cpp. Reads weights packed here, once: build a new one after changing
    the model's weights, dtype or device."""

    name = "exact"
    quantization: str | None = None  # how the products' weights are stored: None (the model's dtype) or 'int8'

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """One product's weight (in, out), packed for this backend's kernels, in its arena (huge pages)."""
        return self.arena.hold(self.pack_weight(weight, bias))

    @staticmethod
    def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """One product's weight (in, out) as this backend's kernels read it."""
        return PackedWeight.pack(weight, bias)

    @functools.cached_property
    def arena(self) -> WeightArena:
        """Where this backend's packed weights live (model/kernels/arena.py)."""
        return WeightArena()

    def __init__(self, model) -> None:
        t = model.transformer
        self.n_embd, self.n_head, self.dtype = model.config.n_embd, model.config.n_head, model.dtype
        self.ln_f = PackedNorm.pack(t.ln_f)
        self.head = self.pack(t.wte.weight.t())  # the tied embedding as the head's (C, V) weight
        blocks = [
            dict(
                ln_1=PackedNorm.pack(b.ln_1),
                c_attn=self.pack(b.attn.c_attn.weight, b.attn.c_attn.bias),
                attn_proj=self.pack(b.attn.c_proj.weight, b.attn.c_proj.bias),
                ln_2=PackedNorm.pack(b.ln_2),
                c_fc=self.pack(b.mlp.c_fc.weight, b.mlp.c_fc.bias),
                mlp_proj=self.pack(b.mlp.c_proj.weight, b.mlp.c_proj.bias),
            )
            for b in t.h
        ]
        layers = (STRUCTS["kv_layer"] * len(blocks))()
        for layer, block in zip(layers, blocks):
            for name, packed in block.items():
                setattr(layer, name, packed.params.data_ptr() if isinstance(packed, PackedNorm) else packed.struct)
        wte, wpe = t.wte.weight.detach(), t.wpe.weight.detach()
        self._keep = (wte, wpe, blocks, layers)  # what the struct points to
        self.weight_bytes = self.head.nbytes + sum(
            p.nbytes for b in blocks for p in b.values() if isinstance(p, PackedWeight)
        )
        self.struct = STRUCTS["kv_model"](
            _DTYPE_CODE[self.dtype],
            _DTYPE_CODE[self.dtype],
            len(blocks),
            self.n_embd,
            self.n_head,
            model.config.layer_norm_epsilon,
            wte.data_ptr(),
            wpe.data_ptr(),
            layers,
        )
        self._cache: weakref.ref | None = None  # the cache whose layer addresses `_pointers` holds
        self._pointers = None

    @property
    def kernel_isa(self) -> str | None:
        return kernel_path(self.head.format)

    def _layer_pointers(self, cache):
        """The cache's layer addresses as the C array the whole-step kernel reads; a cache's layers never move, so
        they are gathered once per cache."""
        if self._cache is None or self._cache() is not cache:
            self._pointers = (ctypes.c_void_p * len(cache.layers))(*(layer.data_ptr() for layer in cache.layers))
            self.struct.cache_dtype = _DTYPE_CODE[cache.dtype]
            self._cache = weakref.ref(cache)
        return self._pointers

    def forward_step(self, step, cache) -> torch.Tensor:
        x = torch.empty((step.num_tokens, self.n_embd), dtype=self.dtype, device=step.token_ids.device)  # (N, C)
        failed = handle().kv_forward(
            ctypes.byref(self.struct),
            self._layer_pointers(cache),
            cache.block_size,
            *step_arguments(step),
            x.data_ptr(),
        )
        if failed:  # checked here, not before every step: the kernels refuse what they lack
            head_dim = self.n_embd // self.n_head
            if not exact_attention_supported(head_dim, cache.block_size):
                raise ValueError(
                    f"the exact attention needs head_dim and block_size multiples of 8, got "
                    f"{head_dim} and {cache.block_size}"
                )
            raise RuntimeError("the exact forward refused its arguments (a dtype, head_dim or block size it lacks)")
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.head, norm=self.ln_f, out_dtype=torch.float32)  # (R, V)
