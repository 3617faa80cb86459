"""Memory read bandwidth and the batch-1 decode bound it implies: `python -m bench.bandwidth`.

Reads a 1 GiB float32 tensor (`sum`, which streams every byte once) several times and reports the
median GB/s; the decode bound is the bytes one batch-1 step must read (every weight once: the layers,
the tied head) divided by that bandwidth. Then times the decode step back to back (100 steps per
sample, context 256, batch 1, 8 and 32), with each kernel set asked for in turns, and gives the
batch-1 step's share of that bound.
"""
from __future__ import annotations

import time

import torch

from bench.common import (base_parser, interleaved_medians, kernel_sets, machine_info, resolve, stock_threads,
                          synchronize, write_result)
from model.checkpoint import load_model
from model.gpt import GPT
from model.kv_cache import PagedKVCache, StepBatch

STEP_CONTEXT = 256
STEPS_PER_SAMPLE = 100
BLOCK_SIZE = 16


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


def decode_steps(model: GPT, batch: int):
    """A function that runs STEPS_PER_SAMPLE decode steps of `batch` sequences at STEP_CONTEXT, each
    over its own blocks (scattered through the cache, as a busy server leaves them)."""
    blocks_each = STEP_CONTEXT // BLOCK_SIZE
    cache = PagedKVCache(model.config, batch * blocks_each + 1, BLOCK_SIZE, dtype=model.dtype, device=model.device)
    tables = [[1 + b + batch * i for i in range(blocks_each)] for b in range(batch)]  # interleaved
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    step = StepBatch.build([([int(t)], STEP_CONTEXT - 1, table) for t, table in zip(tokens, tables)], BLOCK_SIZE,
                           model.device)

    def run():
        for _ in range(STEPS_PER_SAMPLE):
            model.compute_logits(model.forward_step(step, cache))
    return run


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.bandwidth", __doc__)
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    with stock_threads("stock"):  # torch's sum on every core, as the kernels' pool reads
        gbps = read_bandwidth(device, 0.25 if args.quick else 1.0, 3 if args.quick else 9)
    models = {name: load_model(args.checkpoint, device=device, dtype=dtype, kernels=name)
              for name in kernel_sets(args, device, dtype)}
    model = next(iter(models.values()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    positions = model.transformer.wpe.weight  # a step reads one row of it
    step_bytes = weight_bytes - positions.numel() * positions.element_size()
    bound_ms = step_bytes / (gbps * 1e9) * 1e3
    print(f"read bandwidth {gbps:.1f} GB/s; one batch-1 step reads {step_bytes / 1e6:.1f} MB "
          f"(weights {weight_bytes / 1e6:.1f} MB); bound {bound_ms:.2f} ms/token")
    steps = []
    for batch in (1,) if args.quick else (1, 8, 32):
        runs = {name: decode_steps(m, batch) for name, m in models.items()}

        def timed(name, run):
            def call():
                with stock_threads(name):
                    run()
            return call

        times = interleaved_medians({n: timed(n, r) for n, r in runs.items()}, device, 3 if args.quick else 7)
        ms = {name: t["median_s"] / STEPS_PER_SAMPLE * 1e3 for name, t in times.items()}
        steps.append({"batch": batch, "context": STEP_CONTEXT, "step_ms": ms,
                      "samples_ms": {n: [s / STEPS_PER_SAMPLE * 1e3 for s in t["samples_s"]] for n, t in times.items()}})
        print(f"decode step, batch {batch}, context {STEP_CONTEXT}, back to back: "
              + ", ".join(f"{name} {v:.2f} ms" for name, v in ms.items()), flush=True)
    share = {name: bound_ms / v for name, v in steps[0]["step_ms"].items()}
    print("batch-1 step at " + ", ".join(f"{name} {v:.0%}" for name, v in share.items()) + " of the bandwidth bound")
    write_result("bandwidth", {"benchmark": "bandwidth", "machine": machine_info(device, dtype),
                               "read_gb_per_s": gbps, "weight_bytes": weight_bytes, "step_bytes": step_bytes,
                               "batch1_bound_ms": bound_ms, "decode_steps": steps,
                               "batch1_share_of_bound": share}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
