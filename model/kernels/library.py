"""The compiled library, loaded once per process, its thread pool's controls, and the instruction
sets its paths may use.

The kernels pick their path per call from what the CPU has (csrc/cpu.cpp), capped by `KVSERVE_ISA`
(read at load, or `set_isa`): `avx2`, `avx-vnni`, `avx512`, `avx512-vnni`, `amx`, lowest first, or
`auto`, the CPU's highest. A level the CPU lacks is an error, so a forced path never falls back
silently; a lower one lets every path be run and timed on one machine.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from model.kernels.build import KernelBuildError, load
from model.kernels.interface import ISAS, PATHS, WEIGHT_BF16, WEIGHT_BF16_PAIRS, WEIGHT_F32, WEIGHT_INT8

log = logging.getLogger("kvserve.kernels")

SPIN_US = 100  # how long an idle kernel thread spins for the next job before it sleeps (BENCHMARKS.md)
EXACT_DTYPES = (torch.float32, torch.bfloat16)
ISA_ENV = "KVSERVE_ISA"
ISA_CHOICES = ("auto", *ISAS)
# What each level needs of the CPU, for the error that says it lacks one.
_LEVEL_NEEDS = {
    "avx2": "AVX2 and FMA",
    "avx-vnni": "AVX-VNNI",
    "avx512": "AVX-512 F, DQ, BW and VL",
    "avx512-vnni": "AVX512-VNNI",
    "amx": "AMX int8 tiles, granted by the OS",
}
_lock = threading.Lock()
_lib = None
_unavailable: str | None = None


def handle():
    """The loaded C++ library, or None (with the reason logged once) where it cannot be built."""
    global _lib, _unavailable
    if _lib is not None or _unavailable is not None:
        return _lib
    with _lock:
        if _lib is None and _unavailable is None:
            try:
                lib = load()
            except KernelBuildError as e:
                _unavailable = str(e)
                log.warning(
                    "exact kernels unavailable, using torch's kernels instead: cached and uncached logits "
                    "then agree within 1e-4 in float32, not bit for bit (docs/how-it-works/identical.md). "
                    "Reason: %s",
                    e,
                )
                return None
            _cap(lib, configured_isa())  # a level the CPU lacks raises here, at every call, never falls back
            lib.kv_set_num_threads(torch.get_num_threads())
            lib.kv_set_spin_us(configured_spin_us())
            _lib = lib
            paths = ", ".join(f"{weights} on {path}" for weights, path in kernel_paths().items())
            has = ", ".join(cpu_isas())
            log.info("exact kernels: %s (%s=%s; the CPU has %s)", paths, ISA_ENV, configured_isa(), has)
    return _lib


def configured_isa() -> str:
    """KVSERVE_ISA: the level to cap the kernels at (ISAS), or 'auto' (the CPU's highest)."""
    return os.environ.get(ISA_ENV) or "auto"


def _cpu_isas(lib) -> tuple[str, ...]:
    return tuple(name for name, level in ISAS.items() if lib.kv_cpu_has_isa(level))


def _cap(lib, name: str) -> None:
    if name not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_CHOICES)}, got {name!r}")
    has = _cpu_isas(lib)
    if lib.kv_set_isa(ISAS[has[-1] if name == "auto" else name]) != 0:
        raise RuntimeError(f"{ISA_ENV}={name}: this CPU lacks {_LEVEL_NEEDS[name]}; it has {', '.join(has)}")


def set_isa(name: str) -> None:
    """Caps the kernels at level `name` (ISA_CHOICES) from the next call on. Raises ValueError for an
    unknown name, RuntimeError where the CPU lacks the level, as KVSERVE_ISA does. bfloat16 weights are
    packed for the level in force when a model is prepared: prepare it after this."""
    lib = handle()
    if lib is None:
        raise RuntimeError(f"the exact kernels do not run here: {_unavailable}")
    _cap(lib, name)


def isa() -> str | None:
    """The level the kernels are capped at now, None without the library."""
    lib = handle()
    return None if lib is None else next(n for n, level in ISAS.items() if level == lib.kv_isa())


def cpu_isas() -> tuple[str, ...]:
    """The levels this CPU has, lowest first (empty without the library)."""
    lib = handle()
    return () if lib is None else _cpu_isas(lib)


def kernel_path(weight_format: int) -> str | None:
    """The path products on weights of `weight_format` (interface.WEIGHT_*) run on now: 'avx2',
    'avx-vnni', 'avx512', 'avx512-bf16', 'avx512-vnni' or 'amx'; None where none may."""
    lib = handle()
    code = -1 if lib is None else lib.kv_kernel_path(weight_format)
    return PATHS.get(code)


def kernel_paths() -> dict[str, str | None]:
    """The path each weight type's products run on now, as models prepared now pack them."""
    bf16 = kernel_path(WEIGHT_BF16_PAIRS) or kernel_path(WEIGHT_BF16)
    return {"float32": kernel_path(WEIGHT_F32), "bfloat16": bf16, "int8": kernel_path(WEIGHT_INT8)}


def unavailable_reason() -> str | None:
    """Why the exact kernels cannot run on this machine, or None if they can."""
    handle()
    return _unavailable


def kernels_for(device: torch.device, dtype: torch.dtype) -> str:
    """'exact' where our kernels run (CPU, float32 / bfloat16, built), else 'stock'."""
    if os.environ.get("KVSERVE_KERNELS", "auto") == "stock":
        return "stock"
    if device.type != "cpu" or dtype not in EXACT_DTYPES:
        return "stock"
    return "exact" if handle() is not None else "stock"


def set_num_threads(n: int) -> None:
    """Threads the exact kernels split their outputs over (the calling thread included)."""
    lib = handle()
    if lib is not None:
        lib.kv_set_num_threads(max(1, n))


def set_spin_us(microseconds: int) -> None:
    """How long an idle kernel thread spins for the next job before it sleeps (a no-op without the library)."""
    lib = handle()
    if lib is not None:
        lib.kv_set_spin_us(max(0, int(microseconds)))


def spin_us() -> int | None:
    """The idle threads' spin now, in microseconds; None without the library."""
    lib = handle()
    return lib.kv_spin_us() if lib is not None else None


def configured_spin_us() -> int:
    """The spin a long step gets: KVSERVE_KERNEL_SPIN_US, else SPIN_US."""
    return int(os.environ.get("KVSERVE_KERNEL_SPIN_US", SPIN_US))


def num_threads() -> int:
    lib = handle()
    return lib.kv_num_threads() if lib is not None else 0
