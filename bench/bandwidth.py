"""Memory read bandwidth and the batch-1 decode bound it implies: `python -m bench.bandwidth`.

Reads a 1 GiB float32 tensor (`sum`, which streams every byte once) several times and reports the
median GB/s; the decode bound is the bytes one batch-1 step must read (every weight once, as the
kernels store it: float32, bfloat16 or int8 with its scales; the layers, the head) divided by
that bandwidth. Any checkpoint model.checkpoint loads: GPT-2, or a Llama, Qwen2 or Qwen3 one (e.g.
`python -m bench.make_checkpoint --shape smollm2-135m DIR`, then `--checkpoint DIR --dtype bfloat16`).
Then times the decode step back to back (--steps per sample, context 256, batch 1, 8
and 32), with each kernel set asked for in turns, and gives the batch-1 step's share of that bound
and each step's GFLOP/s (2 per weight per row: the products only). Names the instruction-set path
the exact kernels run on (KVSERVE_ISA picks a lower one).
"""

from __future__ import annotations

import time

import torch

from bench.common import (
    base_parser,
    interleaved_medians,
    kernel_sets,
    machine_info,
    resolve,
    stock_threads,
    synchronize,
    write_result,
)
from model.checkpoint import load_model
from model.description import InferenceModel
from model.gpt import GPT
from model.kv_cache import PagedKVCache, StepBatch, resolve_kv_cache_dtype

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


def lookup_tables(model: InferenceModel) -> tuple[list[torch.Tensor], bool]:
    """The embedding tables a step reads one row of per token (GPT-2's token and position embeddings, a
    family's token embedding), and whether the first is also the head (tied)."""
    if isinstance(model, GPT):
        return [model.transformer.wte.weight, model.transformer.wpe.weight], True
    return [model.model.embed_tokens.weight], model.lm_head is None


def step_bytes(model: InferenceModel) -> int:
    """Bytes a batch-1 step reads at least: every product's weights as its kernels store them (the
    head included), and one row of each embedding table."""
    tables, tied = lookup_tables(model)
    rows = sum(t.shape[1] * t.element_size() for t in tables)
    packed = getattr(model.backend, "weight_bytes", None)
    if packed is not None:
        return packed + rows
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    lookups_only = tables[1:] if tied else tables  # read a row at a time, not as a product's weight
    return weights - sum(t.numel() * t.element_size() for t in lookups_only) + rows


def step_flops(model: InferenceModel, batch: int) -> float:
    """Multiply-adds of a step's products, times 2: (layers' weights + the head) per row."""
    c = model.config
    if isinstance(model, GPT):
        per_row = c.n_layer * 12 * c.n_embd**2 + c.n_embd * c.vocab_size
    else:
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        per_row = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    return 2.0 * per_row * batch


def decode_steps(
    model: InferenceModel, batch: int, steps: int = STEPS_PER_SAMPLE, cache_dtype: torch.dtype | None = None
):
    """A function that runs `steps` decode steps of `batch` sequences at STEP_CONTEXT, each
    over its own blocks (scattered through the cache, as a busy server leaves them)."""
    blocks_each = STEP_CONTEXT // BLOCK_SIZE
    cache = PagedKVCache(
        model.config, batch * blocks_each + 1, BLOCK_SIZE, dtype=cache_dtype or model.dtype, device=model.device
    )
    tables = [[1 + b + batch * i for i in range(blocks_each)] for b in range(batch)]  # interleaved
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    step = StepBatch.build(
        [([int(t)], STEP_CONTEXT - 1, table) for t, table in zip(tokens, tables)], BLOCK_SIZE, model.device
    )

    def run():
        for _ in range(steps):
            model.compute_logits(model.forward_step(step, cache))

    return run


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.bandwidth", __doc__)
    ap.add_argument("--name", default="bandwidth", help="the result file's name, in --out")
    ap.add_argument("--steps", type=int, default=STEPS_PER_SAMPLE, help="decode steps per timed sample")
    ap.add_argument("--repeats", type=int, default=7, help="timed samples per batch size (the median is kept)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "int8"],
        help="the KV cache's dtype, as the server's flag of that name",
    )
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    with stock_threads("stock"):  # torch's sum on every core, as the kernels' pool reads
        gbps = read_bandwidth(device, 0.25 if args.quick else 1.0, 3 if args.quick else 9)
    models = {
        name: load_model(
            args.checkpoint,
            device=device,
            dtype=dtype,
            kernels=name,
            quantization=args.quantization if name == "exact" else None,
        )
        for name in kernel_sets(args, device, dtype)
    }
    model = next(iter(models.values()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes = step_bytes(model)
    bound_ms = read_bytes / (gbps * 1e9) * 1e3
    isa = {name: m.kernel_isa for name, m in models.items() if m.kernel_isa is not None}
    print(
        f"read bandwidth {gbps:.1f} GB/s; one batch-1 step reads {read_bytes / 1e6:.1f} MB "
        f"(parameters {weight_bytes / 1e6:.1f} MB, quantization {args.quantization}"
        + "".join(f", {name} kernels on {path}" for name, path in isa.items())
        + f"); bound {bound_ms:.2f} ms/token"
    )
    steps = []
    per_sample = args.steps
    for batch in (1,) if args.quick else args.batches:
        runs = {name: decode_steps(m, batch, per_sample, cache_dtype) for name, m in models.items()}

        def timed(name, run):
            def call():
                with stock_threads(name):
                    run()

            return call

        repeats = 3 if args.quick else args.repeats
        times = interleaved_medians({n: timed(n, r) for n, r in runs.items()}, device, repeats)
        ms = {name: t["median_s"] / per_sample * 1e3 for name, t in times.items()}
        gflops = {name: step_flops(model, batch) / (v * 1e-3) / 1e9 for name, v in ms.items()}
        steps.append(
            {
                "batch": batch,
                "context": STEP_CONTEXT,
                "step_ms": ms,
                "gflop_per_s": gflops,
                "samples_ms": {n: [s / per_sample * 1e3 for s in t["samples_s"]] for n, t in times.items()},
            }
        )
        print(
            f"decode step, batch {batch}, context {STEP_CONTEXT}, back to back: "
            + ", ".join(f"{name} {v:.2f} ms ({gflops[name]:.0f} GFLOP/s)" for name, v in ms.items()),
            flush=True,
        )
    share = {name: bound_ms / v for name, v in steps[0]["step_ms"].items()}
    print("batch-1 step at " + ", ".join(f"{name} {v:.0%}" for name, v in share.items()) + " of the bandwidth bound")
    write_result(
        args.name,
        {
            "benchmark": "bandwidth",
            "machine": machine_info(device, dtype),
            "read_gb_per_s": gbps,
            "weight_bytes": weight_bytes,
            "step_bytes": read_bytes,
            "quantization": args.quantization,
            "kernel_isa": isa,
            "kv_cache_dtype": str(cache_dtype),
            "batch1_bound_ms": bound_ms,
            "decode_steps": steps,
            "batch1_share_of_bound": share,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
