"""The step's kernels: one backend object per prepared model (backend.py), in two implementations.

- **exact** (CPU, float32 and bfloat16; exact.py): our C++ kernels in `csrc/`, compiled on first use
  (`build.py`), their interface declared once in `csrc/api.h` (`interface.py`). Every output element
  is reduced in one fixed order that depends only on the length of the reduction, so cached and
  uncached decoding agree bit for bit.
- **int8** (`int8.py`): the exact backend with every product's weights quantized to int8 per output
  column at load, activations per token in the kernel; still batch-invariant.

Each comes for GPT-2 (model/gpt.py) and for the Llama-style decoders of model/models (`decoder.py`:
RMSNorm in the products' prologue, QK-norm and RoPE, grouped-query attention over the cache, SwiGLU in
the products' epilogue); `choose_backend` picks by the model's config.

The exact kernels run on any x86-64 CPU with AVX2 and FMA, each product on the widest path the CPU
has (AVX2, AVX-VNNI, AVX-512, AVX512-BF16, AVX512-VNNI, AMX), picked per call; `KVSERVE_ISA` (or
`set_isa`) caps that level, and `kernel_paths()` says which path each weight type takes (library.py).
- **stock** (`stock.py`): torch's own kernels. Used on CUDA, for float16 and float64, and on a
  CPU where the exact kernels cannot be built (no compiler, no AVX2); there cached and uncached logits
  agree within a tolerance instead (docs/how-it-works/identical.md).

`choose_backend(model, name)` builds one; `kernels_for(device, dtype)` says which runs where, and
`KVSERVE_KERNELS=stock` forces the stock kernels everywhere.
"""

from __future__ import annotations

from model.config import GPTConfig
from model.kernels import stock
from model.kernels.backend import KernelBackend
from model.kernels.decoder import DecoderExactBackend, DecoderInt8Backend, interleave_gate_up, rope_table
from model.kernels.exact import (
    GROUP,
    STRIP,
    ExactBackend,
    PackedNorm,
    PackedWeight,
    embed,
    exact_attention_supported,
    greedy,
    greedy_masked,
    linear,
    paged_attention,
    rope,
)
from model.kernels.int8 import QUANTIZATIONS, Int8Backend, int8_unavailable_reason
from model.kernels.interface import (
    EPILOGUE_GELU,
    EPILOGUE_NONE,
    EPILOGUE_RESIDUAL,
    EPILOGUE_SILU_MUL,
    INT8_CACHE_MAX_BLOCK,
)
from model.kernels.library import (
    ISA_CHOICES,
    configured_spin_us,
    cpu_isas,
    isa,
    kernel_paths,
    kernels_for,
    num_threads,
    set_isa,
    set_num_threads,
    set_spin_us,
    spin_us,
    unavailable_reason,
)
from model.kernels.stock import DecoderStockBackend, StockBackend

KERNEL_CHOICES = ("auto", "exact", "stock")


def choose_backend(model, name: str = "auto", quantization: str | None = None) -> KernelBackend:
    """The backend `name` asks for ('auto': exact where it runs, see kernels_for) for a model of
    model/gpt.py or model/models (a decoder family's CausalLM), built from its current weights;
    quantization='int8' quantizes its products' weights (exact kernels only). Raises ValueError for an
    unknown name or a combination that cannot be, and RuntimeError where the kernels asked for do not run
    here."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be 'auto', 'exact' or 'stock', got {name!r}")
    if isinstance(model.config, GPTConfig):
        stock_backend, exact_backend, int8_backend = StockBackend, ExactBackend, Int8Backend
    else:  # a decoder family's CausalLM (model/models)
        stock_backend, exact_backend, int8_backend = DecoderStockBackend, DecoderExactBackend, DecoderInt8Backend
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        if name == "stock":
            raise ValueError("int8 weights run on the exact kernels only, not with kernels='stock'")
        return int8_backend(model)
    runs_here = kernels_for(model.device, model.dtype)
    if not exact_attention_supported(model.config.head_dim, 8):
        runs_here = "stock"
    choice = runs_here if name == "auto" else name
    if choice == "exact" and runs_here != "exact":
        why = unavailable_reason() or "they need a CPU, float32 or bfloat16, and a head_dim of 8, 16, 32, 64 or 128"
        raise RuntimeError(
            f"the exact kernels do not run here ({model.device}, {model.dtype}, head_dim "
            f"{model.config.head_dim}): {why}"
        )
    return exact_backend(model) if choice == "exact" else stock_backend(model)


__all__ = [
    "EPILOGUE_GELU",
    "EPILOGUE_NONE",
    "EPILOGUE_RESIDUAL",
    "EPILOGUE_SILU_MUL",
    "GROUP",
    "INT8_CACHE_MAX_BLOCK",
    "ISA_CHOICES",
    "KERNEL_CHOICES",
    "QUANTIZATIONS",
    "STRIP",
    "ExactBackend",
    "Int8Backend",
    "KernelBackend",
    "PackedNorm",
    "PackedWeight",
    "DecoderExactBackend",
    "DecoderInt8Backend",
    "DecoderStockBackend",
    "StockBackend",
    "choose_backend",
    "configured_spin_us",
    "cpu_isas",
    "embed",
    "exact_attention_supported",
    "greedy",
    "greedy_masked",
    "int8_unavailable_reason",
    "interleave_gate_up",
    "isa",
    "kernel_paths",
    "kernels_for",
    "linear",
    "num_threads",
    "paged_attention",
    "rope",
    "rope_table",
    "set_isa",
    "set_num_threads",
    "set_spin_us",
    "spin_us",
    "stock",
    "unavailable_reason",
]
