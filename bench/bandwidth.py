"""Memory read bandwidth and the batch-1 decode bound it implies: `python -m bench.bandwidth`.

Reads a 1 GiB float32 tensor (`sum`, which streams every byte once) several times and reports the
median GB/s; the decode bound is the bytes one batch-1 step must read (every weight, the head's own
copy included) divided by that bandwidth.
"""
from __future__ import annotations

import time

import torch

from bench.common import base_parser, machine_info, resolve, synchronize, write_result
from model.checkpoint import load_model


def read_bandwidth(device: torch.device, gib: float, repeats: int) -> float:
    data = torch.ones(int(gib * 2**30 // 4), dtype=torch.float32, device=device)  # (N,)
    data.sum()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        data.sum()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / sorted(times)[len(times) // 2] / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.bandwidth", __doc__)
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    gbps = read_bandwidth(device, 0.25 if args.quick else 1.0, 3 if args.quick else 9)
    model = load_model(args.checkpoint, device=device, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = (model.transformer.wte.weight, model.transformer.wpe.weight)  # a step reads one row of each
    step_bytes = weight_bytes - sum(t.numel() * t.element_size() for t in tables)
    step_bytes += model.head_blocks.numel() * model.head_blocks.element_size()  # the head reads its own copy
    bound_ms = step_bytes / (gbps * 1e9) * 1e3
    print(f"read bandwidth {gbps:.1f} GB/s; one batch-1 step reads {step_bytes / 1e6:.1f} MB "
          f"(weights {weight_bytes / 1e6:.1f} MB); bound {bound_ms:.2f} ms/token")
    write_result("bandwidth", {"benchmark": "bandwidth", "machine": machine_info(device, dtype),
                               "read_gb_per_s": gbps, "weight_bytes": weight_bytes, "step_bytes": step_bytes,
                               "batch1_bound_ms": bound_ms}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
