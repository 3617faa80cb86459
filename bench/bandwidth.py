"""Memory read bandwidth and the batch-1 decode bound it implies: `python -m bench.bandwidth`.

Reads a 1 GiB float32 tensor (`sum`, which streams every byte once) several times and reports the
median GB/s; the decode bound is the bytes one batch-1 step must read (every weight, the head's own
copy included) divided by that bandwidth. Then times the decode step back to back (100 steps per
sample, context 256, batch 1, 8 and 32; with --compile the compiled step too, in turns) and gives
the batch-1 step's share of that bound.
"""
from __future__ import annotations

import time

import torch

from bench.common import base_parser, interleaved_medians, machine_info, resolve, synchronize, write_result
from model.checkpoint import load_model
from model.generate import decode_one_token
from model.gpt import GPT
from model.kv_cache import KVCache

STEP_CONTEXT = 256
STEPS_PER_SAMPLE = 100


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


def decode_step_ms(model: GPT, batch: int, compiled: bool, repeats: int) -> dict[str, float]:
    """Median ms of one decode step at STEP_CONTEXT, run back to back (weights stay warm in the CPU
    caches, as when the engine decodes), eager and (if `compiled`) compiled, in turns."""
    device, dtype = model.transformer.wte.weight.device, model.transformer.wte.weight.dtype
    cache = KVCache(model.config, batch, dtype=dtype, device=device)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=device)  # (B,)
    positions = torch.full((batch,), STEP_CONTEXT - 1, device=device)  # (B,)

    def steps(compiled_step: bool):
        return lambda: [decode_one_token(model, cache, tokens, positions, slice(0, batch), kv_len=STEP_CONTEXT,
                                         compiled=compiled_step) for _ in range(STEPS_PER_SAMPLE)]

    fns = {"eager": steps(False)} | ({"compiled": steps(True)} if compiled else {})
    times = interleaved_medians(fns, device, repeats, warmup=1)
    return {name: t["median_s"] / STEPS_PER_SAMPLE * 1e3 for name, t in times.items()}


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
    steps = []
    for batch in (1,) if args.quick else (1, 8, 32):
        ms = decode_step_ms(model, batch, args.compile, 3 if args.quick else 7)
        steps.append({"batch": batch, "context": STEP_CONTEXT, "step_ms": ms})
        print(f"decode step, batch {batch}, context {STEP_CONTEXT}, back to back: "
              + ", ".join(f"{name} {v:.2f} ms" for name, v in ms.items()))
    share = {name: bound_ms / v for name, v in steps[0]["step_ms"].items()}
    print("batch-1 step at " + ", ".join(f"{name} {v:.0%}" for name, v in share.items()) + " of the bandwidth bound")
    write_result("bandwidth", {"benchmark": "bandwidth", "machine": machine_info(device, dtype),
                               "read_gb_per_s": gbps, "weight_bytes": weight_bytes, "step_bytes": step_bytes,
                               "batch1_bound_ms": bound_ms, "decode_steps": steps,
                               "batch1_share_of_bound": share}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
