"""The step's kernels, in two implementations with one interface.

- **exact** (CPU, float32 and bfloat16): our C++ kernels in `csrc/`, compiled on first use
  (`build.py`). Every output element is reduced in one fixed order that depends only on the length
  of the reduction, so a token's logits do not depend on how many rows share its step, where its row
  sits, whether its keys came from a prefix-cache hit, or whether it was decoded or recomputed:
  cached and uncached decoding agree bit for bit.
- **stock** (`stock.py`): torch's own kernels. Used on CUDA, for float16 and float64, and on a
  CPU where the exact kernels cannot be built (no compiler, no AVX2); there cached and uncached logits
  agree within a tolerance instead (README.md, "What identical means").

`kernels_for(device, dtype)` picks one; `KVSERVE_KERNELS=stock` forces the stock kernels everywhere.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from dataclasses import dataclass

import torch

from model.kernels import stock
from model.kernels.build import KernelBuildError, load

log = logging.getLogger("kvserve.kernels")

GROUP = 64  # output columns per packed weight group: one task of csrc/linear.cpp
STRIP = 16  # output columns per strip of a group, each stored k-major
EPILOGUE_NONE, EPILOGUE_GELU, EPILOGUE_RESIDUAL = 0, 1, 2
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_EXACT_DTYPES = tuple(_DTYPE_CODE)

SPIN_US = 100  # how long an idle kernel thread spins for the next job before it sleeps (BENCHMARKS.md)
_lock = threading.Lock()
_lib = None
_unavailable: str | None = None


def _library():
    """The loaded C++ library, or None (with the reason logged once) where it cannot be built."""
    global _lib, _unavailable
    if _lib is not None or _unavailable is not None:
        return _lib
    with _lock:
        if _lib is None and _unavailable is None:
            try:
                _lib = load()
                _lib.kv_set_num_threads(torch.get_num_threads())
                _lib.kv_set_spin_us(int(os.environ.get("KVSERVE_KERNEL_SPIN_US", SPIN_US)))
            except KernelBuildError as e:
                _unavailable = str(e)
                log.warning("exact kernels unavailable, using torch's kernels instead: cached and uncached logits "
                            "then agree within 1e-4 in float32, not bit for bit (README.md, 'What identical "
                            "means'). Reason: %s", e)
    return _lib


def unavailable_reason() -> str | None:
    """Why the exact kernels cannot run on this machine, or None if they can."""
    _library()
    return _unavailable


def kernels_for(device: torch.device, dtype: torch.dtype) -> str:
    """'exact' where our kernels run (CPU, float32 / bfloat16, built), else 'stock'."""
    if os.environ.get("KVSERVE_KERNELS", "auto") == "stock":
        return "stock"
    if device.type != "cpu" or dtype not in _EXACT_DTYPES:
        return "stock"
    return "exact" if _library() is not None else "stock"


def set_num_threads(n: int) -> None:
    """Threads the exact kernels split their outputs over (the calling thread included)."""
    lib = _library()
    if lib is not None:
        lib.kv_set_num_threads(max(1, n))


def num_threads() -> int:
    lib = _library()
    return lib.kv_num_threads() if lib is not None else 0


@dataclass
class PackedWeight:
    """A linear layer's (in, out) weight packed for csrc/linear.cpp: (groups, 4, in, 16), strips of 16
    columns each stored k-major, zero past `n_out`, with its bias in float32 (zeros where the layer has
    none), padded to the groups."""

    weight: torch.Tensor  # (groups, GROUP // STRIP, n_in, STRIP)
    bias: torch.Tensor  # (groups * GROUP,) float32
    n_in: int
    n_out: int

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedWeight":
        """weight: (in, out), GPT-2's Conv1D layout (for the tied head, the embedding transposed)."""
        n_in, n_out = weight.shape
        groups = -(-n_out // GROUP)
        padded = torch.zeros(n_in, groups * GROUP, dtype=weight.dtype, device=weight.device)  # (in, out padded)
        padded[:, :n_out] = weight.detach()
        strips = padded.view(n_in, groups, GROUP // STRIP, STRIP).permute(1, 2, 0, 3)  # (groups, 4, in, STRIP)
        packed = strips.contiguous()
        b = torch.zeros(groups * GROUP, dtype=torch.float32, device=weight.device)
        if bias is not None:
            b[:n_out] = bias.detach().float()
        return cls(packed, b, n_in, n_out)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


@dataclass
class PackedNorm:
    """A LayerNorm's weight and bias in float32, (2, C), for the linear kernel's prologue."""

    params: torch.Tensor  # (2, C) float32: weight, bias
    eps: float

    @classmethod
    def pack(cls, norm: torch.nn.LayerNorm) -> "PackedNorm":
        return cls(torch.stack([norm.weight.detach().float(), norm.bias.detach().float()]).contiguous(), norm.eps)


def linear(x: torch.Tensor, w: PackedWeight, epilogue: int = EPILOGUE_NONE, residual: torch.Tensor | None = None,
           *, norm: PackedNorm | None = None, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """epilogue(norm(x) @ W + b) through csrc/linear.cpp. x: (N, in) contiguous, in the weights' dtype.
    norm: a layer norm applied to each row of x first. epilogue: EPILOGUE_NONE, EPILOGUE_GELU (tanh
    GELU) or EPILOGUE_RESIDUAL (residual + (x @ W + b)). out: where to write (N, out); it may be
    `residual` itself. Returns (N, out) in x's dtype, or float32 with out_dtype=torch.float32
    (bfloat16 models' logits)."""
    out_dtype = out_dtype or x.dtype
    code = _DTYPE_CODE[x.dtype] if out_dtype == x.dtype else 2
    if x.dtype != w.weight.dtype or (code == 2 and (x.dtype, out_dtype) != (torch.bfloat16, torch.float32)):
        raise TypeError(f"linear: activations {x.dtype}, weights {w.weight.dtype}, output {out_dtype}")
    rows = x.shape[0]
    y = torch.empty((rows, w.n_out), dtype=out_dtype, device=x.device) if out is None else out
    ln = norm.params.data_ptr() if norm is not None else None
    _lib.kv_linear(code, x.contiguous().data_ptr(), rows, w.n_in, w.weight.data_ptr(), w.bias.data_ptr(),
                   y.data_ptr(), w.n_out, epilogue, residual.data_ptr() if residual is not None else None,
                   ln, ln + 4 * w.n_in if ln is not None else None, norm.eps if norm is not None else 0.0)
    return y


def embed(token_ids: torch.Tensor, positions: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor) -> torch.Tensor:
    """wte[token_ids] + wpe[positions]: (N, C), through csrc/embedding.cpp."""
    n, C = token_ids.shape[0], wte.shape[1]
    out = torch.empty((n, C), dtype=wte.dtype, device=wte.device)
    _lib.kv_embed(_DTYPE_CODE[wte.dtype], token_ids.data_ptr(), positions.data_ptr(), n, wte.data_ptr(),
                  wpe.data_ptr(), C, out.data_ptr())
    return out


class _Layer(ctypes.Structure):
    """csrc/forward.cpp's Layer: one block's packed weights."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("ln_1", "c_attn_w", "c_attn_b", "attn_proj_w", "attn_proj_b",
                                                     "ln_2", "c_fc_w", "c_fc_b", "mlp_proj_w", "mlp_proj_b")]


class _Model(ctypes.Structure):
    """csrc/forward.cpp's Model."""
    _fields_ = [("dtype", ctypes.c_int64), ("n_layer", ctypes.c_int64), ("n_embd", ctypes.c_int64),
                ("n_head", ctypes.c_int64), ("eps", ctypes.c_float), ("wte", ctypes.c_void_p),
                ("wpe", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer))]


class ExactModel:
    """The pointers csrc/forward.cpp reads for a whole forward, gathered once from a prepared model:
    each block's packed weights and layer norms, and the embeddings. Holds what it points to."""

    def __init__(self, wte: torch.Tensor, wpe: torch.Tensor, blocks: list[dict[str, PackedWeight | PackedNorm]],
                 n_head: int, eps: float) -> None:
        self._keep = (wte, wpe, blocks)
        layers = (_Layer * len(blocks))()
        for layer, block in zip(layers, blocks):
            for name, packed in block.items():
                if isinstance(packed, PackedNorm):
                    setattr(layer, name, packed.params.data_ptr())
                else:
                    setattr(layer, f"{name}_w", packed.weight.data_ptr())
                    setattr(layer, f"{name}_b", packed.bias.data_ptr())
        self._layers = layers
        self.struct = _Model(_DTYPE_CODE[wte.dtype], len(blocks), wte.shape[1], n_head, eps, wte.data_ptr(),
                             wpe.data_ptr(), layers)
        self.dtype = wte.dtype

    def forward(self, step, cache) -> torch.Tensor:
        """Embeddings and every block for the step's N tokens: hidden states (N, C), before ln_f."""
        N = step.num_tokens
        x = torch.empty((N, self.struct.n_embd), dtype=self.dtype, device=step.token_ids.device)
        pointers = cache.__dict__.get("_layer_pointers")
        if pointers is None:  # the cache's layer addresses never change: gathered once
            pointers = cache._layer_pointers = (ctypes.c_void_p * len(cache.layers))(
                *(layer.data_ptr() for layer in cache.layers))
        failed = _lib.kv_forward(ctypes.byref(self.struct), pointers, cache.block_size, step.token_ids.data_ptr(),
                                 step.positions.data_ptr(), N, step.slot_mapping.data_ptr(), step.num_seqs,
                                 step.query_start.data_ptr(), step.seq_lens.data_ptr(), step.block_tables.data_ptr(),
                                 step.block_tables.stride(0), step.seq_rows.data_ptr(), x.data_ptr())
        if failed:  # checked here, not before every step: the kernels refuse what they lack
            if not exact_attention_supported(self.struct.n_embd // self.struct.n_head, cache.block_size):
                raise ValueError(f"the exact attention needs head_dim and block_size multiples of 8, got "
                                 f"{self.struct.n_embd // self.struct.n_head} and {cache.block_size}")
            raise RuntimeError("the exact forward refused its arguments (a dtype, head_dim or block size it lacks)")
        return x


def greedy(logits: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Per row of float32 (R, V) logits: out (R, >= 3) float64 gets the first index of the largest logit,
    its logprob and 1 if the row is finite; lse (R,) float32 gets log(sum(exp)). Each row in one fixed
    order (csrc/sampling.cpp)."""
    _lib.kv_greedy(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), out.stride(0), lse.data_ptr())


EXACT_HEAD_DIMS = (8, 16, 32, 64, 128)


def exact_attention_supported(head_dim: int, block_size: int) -> bool:
    return head_dim in EXACT_HEAD_DIMS and block_size % 8 == 0


def paged_attention(qkv: torch.Tensor, cache_layer: torch.Tensor, step, n_head: int, block_size: int) -> torch.Tensor:
    """Writes each token's keys/values to its slot, then attends over its sequence's blocks, through
    csrc/attention.cpp. qkv: (N, 3C) contiguous; cache_layer: (num_blocks, 2, nh, bs * hd).
    step: model.kv_cache.StepBatch. Returns (N, C)."""
    N, C3 = qkv.shape  # N == step.num_tokens
    C = C3 // 3
    head_dim = C // n_head
    out = torch.empty((N, C), dtype=qkv.dtype, device=qkv.device)
    _lib.kv_paged_attention(_DTYPE_CODE[qkv.dtype], qkv.data_ptr(), N, n_head, head_dim, cache_layer.data_ptr(),
                           block_size, step.slot_mapping.data_ptr(), step.num_seqs, step.query_start.data_ptr(),
                           step.seq_lens.data_ptr(), step.block_tables.data_ptr(), step.block_tables.stride(0),
                           step.seq_rows.data_ptr(), 1.0 / math.sqrt(head_dim), out.data_ptr())
    return out


__all__ = ["EPILOGUE_GELU", "EPILOGUE_NONE", "EPILOGUE_RESIDUAL", "GROUP", "STRIP", "ExactModel", "PackedNorm", "PackedWeight",
           "embed", "greedy",
           "exact_attention_supported",
           "kernels_for", "linear", "num_threads", "paged_attention", "set_num_threads", "stock",
           "unavailable_reason"]
