"""The compiled library, loaded once per process, and its thread pool's controls."""

from __future__ import annotations

import logging
import os
import threading

import torch

from model.kernels.build import KernelBuildError, load

log = logging.getLogger("kvserve.kernels")

SPIN_US = 100  # how long an idle kernel thread spins for the next job before it sleeps (BENCHMARKS.md)
EXACT_DTYPES = (torch.float32, torch.bfloat16)
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
                lib.kv_set_num_threads(torch.get_num_threads())
                lib.kv_set_spin_us(configured_spin_us())
                _lib = lib
            except KernelBuildError as e:
                _unavailable = str(e)
                log.warning(
                    "exact kernels unavailable, using torch's kernels instead: cached and uncached logits "
                    "then agree within 1e-4 in float32, not bit for bit (docs/how-it-works/identical.md). "
                    "Reason: %s",
                    e,
                )
    return _lib


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
