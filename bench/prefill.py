"""Prompt throughput: `python -m bench.prefill [--quick]`.

Times the forward of whole prompts (one of 512 tokens, and four of 128 in one step), with the logits
of each prompt's last token, through each kernel set in turns: ours (exact) and torch's (stock: MKL's
addmm for the products, SDPA for attention). Reports prompt tokens per second.
"""

from __future__ import annotations

import torch

from bench.common import (
    base_parser,
    interleaved_medians,
    kernel_sets,
    machine_info,
    resolve,
    stock_threads,
    write_result,
)
from model.checkpoint import load_model
from model.description import InferenceModel
from model.kv_cache import PagedKVCache, StepBatch

BLOCK_SIZE = 16


def prefill_fn(model: InferenceModel, prompts: list[list[int]]):
    per_seq = -(-max(len(p) for p in prompts) // BLOCK_SIZE)
    cache = PagedKVCache(model.config, len(prompts) * per_seq, BLOCK_SIZE, dtype=model.dtype, device=model.device)
    step = StepBatch.build(
        [(p, 0, list(range(i * per_seq, (i + 1) * per_seq))) for i, p in enumerate(prompts)], BLOCK_SIZE, model.device
    )
    last = step.query_start[1:].long() - 1

    def run():
        return model.compute_logits(model.forward_step(step, cache)[last])

    return run


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.prefill", __doc__)
    ap.add_argument("--repeats", type=int, default=None, help="default 9 (2 with --quick)")
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    args.kernels = "both" if args.kernels == "auto" else args.kernels
    models = {
        name: load_model(args.checkpoint, device=device, dtype=dtype, kernels=name)
        for name in kernel_sets(args, device, dtype)
    }
    vocab, context = next(iter(models.values())).config.vocab_size, next(iter(models.values())).config.context_length
    g = torch.Generator().manual_seed(0)
    shapes = {"1x512": [min(512, context)], "4x128": [128] * 4}
    if args.quick:
        shapes = {"1x64": [64]}
    rows = []
    for label, lengths in shapes.items():
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        fns = {}
        for name, model in models.items():
            run = prefill_fn(model, prompts)

            def timed(run=run, name=name):
                with stock_threads(name):
                    run()

            fns[name] = timed
        times = interleaved_medians(fns, device, args.repeats or (2 if args.quick else 9), warmup=1)
        tps = {name: sum(lengths) / t["median_s"] for name, t in times.items()}
        row = {"prompts": label, "tokens": sum(lengths), "tokens_per_s": tps, "samples_s": times}
        if "exact" in tps and "stock" in tps:
            row["exact_over_stock"] = tps["exact"] / tps["stock"]
        rows.append(row)
        print(
            f"{label}: "
            + ", ".join(f"{n} {v:.0f} tok/s" for n, v in tps.items())
            + (f"; exact/stock {row['exact_over_stock']:.2f}x" if "exact_over_stock" in row else ""),
            flush=True,
        )
    write_result(
        "prefill",
        {
            "benchmark": "prefill",
            "machine": machine_info(device, dtype),
            "checkpoint": args.checkpoint,
            "quick": args.quick,
            "runs": rows,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
