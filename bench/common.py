"""What every benchmark shares: its command-line flags, a machine description, timing, JSON output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model import kernels
from model.checkpoint import DEFAULT_CHECKPOINT
from model.device import resolve_device, resolve_dtype

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def base_parser(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--device", default="auto", help="auto picks CUDA when present")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    ap.add_argument("--out", default=None, help=f"output folder (default {RESULTS_DIR})")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, few repeats")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per core)")
    ap.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "exact", "stock", "both"],
        help="the step's kernels: ours (exact), torch's (stock), or both side by side (default: exact where they run)",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["int8"],
        help="int8: the products' weights quantized at load (model.kernels.int8)",
    )
    return ap


def resolve(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Device and dtype from the flags. Applies --threads: to the exact kernels' pool, with torch on
    one thread (as the engine runs them), unless only the stock kernels are asked for."""
    threads = args.threads or os.cpu_count() or 1
    kernels.set_num_threads(threads)
    torch.set_num_threads(threads if args.kernels == "stock" else 1)
    return resolve_device(args.device), resolve_dtype(args.dtype)


def kernel_sets(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The kernels to time: ['exact', 'stock'] for --kernels both, else the one asked for (auto: what runs)."""
    if args.kernels == "both":
        return ["exact", "stock"] if kernels.kernels_for(device, dtype) == "exact" else ["stock"]
    if args.kernels == "auto":
        return [kernels.kernels_for(device, dtype)]
    return [args.kernels]


def stock_threads(name: str) -> contextlib.AbstractContextManager:
    """torch's own thread count while the stock kernels run (they use torch's pool, the exact ones theirs)."""
    return _torch_threads(os.cpu_count() or 1) if name == "stock" else contextlib.nullcontext()


@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: torch.device | None = None, dtype: torch.dtype | None = None) -> dict:
    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "kernel_threads": kernels.num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device) if device is not None else None,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call, waiting for the device to finish."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 1
) -> dict[str, dict]:
    """Times each fn `repeats` times, taking turns (a, b, a, b, ...) so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_once(fn, device))
    return {name: {"median_s": statistics.median(s), "min_s": min(s), "samples_s": s} for name, s in samples.items()}


def write_result(name: str, result: dict, out: str | None) -> Path:
    folder = Path(out) if out else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    text = json.dumps(result, indent=2) + "\n"
    repo = str(Path(__file__).resolve().parents[1])
    path.write_text(text.replace(repo + "/", "").replace(repo, "."))  # paths relative to the repo, not this machine
    print(f"wrote {path}")
    return path
