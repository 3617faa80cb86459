"""What every benchmark shares: its command-line flags, a machine description, timing, JSON output."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

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
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--compile", action="store_true",
                    help="also time decode steps through torch.compile (the server's --compile)")
    return ap


def resolve(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Device and dtype from the flags; applies --threads."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device), resolve_dtype(args.dtype)


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


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                        warmup: int = 1) -> dict[str, dict]:
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
