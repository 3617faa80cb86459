"""The step's kernels: one backend object per prepared model (backend.py), in two implementations.

- **exact** (CPU, float32 and bfloat16; exact.py): our C++ kernels in `csrc/`, compiled on first use
  (`build.py`), their interface declared once in `csrc/api.h` (`interface.py`). Every output element
  is reduced in one fixed order that depends only on the length of the reduction, so cached and
  uncached decoding agree bit for bit.
- **int8** (`int8.py`): the exact backend with every product's weights quantized to int8 per output
  column at load, activations per token in the kernel; still batch-invariant.

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
from model.kernels.exact import (
    GROUP,
    STRIP,
    ExactBackend,
    PackedNorm,
    PackedWeight,
    embed,
    exact_attention_supported,
    greedy,
    linear,
    paged_attention,
)
from model.kernels.int8 import QUANTIZATIONS, Int8Backend, int8_unavailable_reason
from model.kernels.interface import EPILOGUE_GELU, EPILOGUE_NONE, EPILOGUE_RESIDUAL
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
    if not isinstance(model.config, GPTConfig):  # a decoder family (model/models): torch's kernels so far
        if name == "exact" or quantization is not None:
            raise RuntimeError("the exact and int8 kernels do not run the decoder families yet")
        return DecoderStockBackend(model)
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        if name == "stock":
            raise ValueError("int8 weights run on the exact kernels only, not with kernels='stock'")
        return Int8Backend(model)
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
    return ExactBackend(model) if choice == "exact" else StockBackend(model)


__all__ = [
    "EPILOGUE_GELU",
    "EPILOGUE_NONE",
    "EPILOGUE_RESIDUAL",
    "GROUP",
    "ISA_CHOICES",
    "KERNEL_CHOICES",
    "QUANTIZATIONS",
    "STRIP",
    "ExactBackend",
    "Int8Backend",
    "KernelBackend",
    "PackedNorm",
    "PackedWeight",
    "DecoderStockBackend",
    "StockBackend",
    "choose_backend",
    "configured_spin_us",
    "cpu_isas",
    "embed",
    "exact_attention_supported",
    "greedy",
    "int8_unavailable_reason",
    "isa",
    "kernel_paths",
    "kernels_for",
    "linear",
    "num_threads",
    "paged_attention",
    "set_isa",
    "set_num_threads",
    "set_spin_us",
    "spin_us",
    "stock",
    "unavailable_reason",
]
