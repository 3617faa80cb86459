"""Compiles the C++ kernels in `csrc/` on first use and loads them with ctypes.

The library is plain C++ with no torch or Python headers, so it builds in seconds with the system's
`g++` and works with any torch version. It is compiled for x86-64-v3 (AVX2 and FMA), its wider paths
(AVX-512, VNNI, AMX) each for its own instruction set, picked when they run (csrc/cpu.h), so one build
serves any CPU with AVX2; it refuses to load on a CPU without. It is cached under
`$KVSERVE_KERNEL_CACHE` (default `~/.cache/kvserve`), keyed by a hash of the sources, the flags, the
compiler and the CPU (tuned for it), and built into a temporary file then renamed, so processes that
build at once do not clash. The functions'
ctypes come from their one declaration, csrc/api.h (interface.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from model.kernels.interface import ABI_VERSION, SIGNATURES

log = logging.getLogger("kvserve.kernels")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# No fast-math, and no FMA contraction the sources do not spell out: every fused multiply-add in the
# kernels is an explicit intrinsic, on every code path, tails included. x86-64-v3 is the floor every
# path needs; the wider ones carry target attributes (csrc/cpu.h).
FLAGS = [
    "-O3",
    "-march=x86-64-v3",
    "-mtune=native",
    "-std=c++20",
    "-shared",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-pthread",
]
FLOOR_FLAGS = ("avx2", "fma")  # /proc/cpuinfo's names for the instruction sets of x86-64-v3 the kernels use


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here."""


def _cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "kvserve")


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _missing_floor() -> list[str]:
    """The floor's instruction sets this CPU lacks, by /proc/cpuinfo ([] where it cannot be read: the
    compiler then decides)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return [flag for flag in FLOOR_FLAGS if flag not in flags]


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (install g++, or set CXX)")
    return cxx


def library_path() -> Path:
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e
    digest = hashlib.sha256()
    for part in [version, _cpu_id(), " ".join(FLAGS), str(ABI_VERSION)]:
        digest.update(part.encode())
    for source in sorted(SOURCE_DIR.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return _cache_dir() / f"libkvkernels-{digest.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    cxx = _compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in SOURCE_DIR.glob("*.cpp"))
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        target = Path(tmp) / path.name
        cmd = [cxx, *FLAGS, *sources, "-o", str(target)]
        log.info("compiling the exact kernels: %s", " ".join(cmd))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"compiling the kernels failed: {e}") from e
        if done.returncode != 0:
            raise KernelBuildError(f"compiling the kernels failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(target, path)


def load() -> ctypes.CDLL:
    """The kernels library, compiled first if this machine has no build of these sources yet."""
    missing = _missing_floor()
    if missing:
        raise KernelBuildError(f"this CPU lacks {' and '.join(missing).upper()}, which every path of the kernels needs")
    path = library_path()
    if not path.exists():
        build(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    if lib.kv_abi_version() != ABI_VERSION:
        raise KernelBuildError(f"{path} has ABI {lib.kv_abi_version()}, expected {ABI_VERSION}")
    return lib
