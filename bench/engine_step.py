"""The engine's decode step, whole: `python -m bench.engine_step [--threads 1]`.

Where bench.bandwidth times the model's forward alone, this times `Engine.step()` (schedule, the
runner's preparation, the forward, the pick, the update) on a stopped engine, in process: B greedy
requests of a PROMPT_TOKENS-token prompt are read first, then STEPS decode steps are timed, several
samples per batch size, and the median step is reported, in wall time and in the process's CPU
time (with --threads 1 the CPU time is the step's work, which the neighbours on a shared machine
disturb much less than the wall clock).
"""

from __future__ import annotations

import statistics
import time

from bench.common import base_parser, machine_info, resolve, write_result
from model.checkpoint import load_model, load_tokenizer
from model.sampling import SamplingParams
from server.engine import Engine

PROMPT_TOKENS = 200
STEPS = 40


def step_times(engine: Engine, batch: int, samples: int) -> tuple[list[float], list[float]]:
    """Seconds per decode step, wall and CPU (the process's), one median each per sample, for `batch`
    requests decoding together."""
    prompt = [(17 * i) % 5000 + 1 for i in range(PROMPT_TOKENS)]
    params = SamplingParams(max_new_tokens=STEPS * samples + 8, temperature=0, ignore_eos=True)
    sinks = [[] for _ in range(batch)]
    for i, sink in enumerate(sinks):
        engine.submit(prompt[i:] + prompt[:i], params, sink.append, use_cache=True)
    while any(not s for s in sinks):  # every prompt read, every request decoding
        engine.step()
    walls, cpus = [], []
    for _ in range(samples):
        wall, cpu = [], []
        for _ in range(STEPS):
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.step()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        walls.append(statistics.median(wall))
        cpus.append(statistics.median(cpu))
    while engine.num_running or engine.num_waiting:  # run them out
        engine.step()
    return walls, cpus


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.engine_step", __doc__)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--samples", type=int, default=3)
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    model = load_model(
        args.checkpoint, device=device, dtype=dtype, kernels=args.kernels if args.kernels != "both" else "auto"
    )
    engine = Engine(model, load_tokenizer(args.checkpoint), threads=args.threads, max_num_seqs=64)
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        walls, cpus = step_times(engine, batch, args.samples)
        results[batch] = {"wall_ms": statistics.median(walls) * 1e3, "cpu_ms": statistics.median(cpus) * 1e3}
        print(
            f"batch {batch:3d}: engine step {results[batch]['wall_ms']:.3f} ms wall, {results[batch]['cpu_ms']:.3f} "
            f"ms CPU (samples {[round(m * 1e3, 3) for m in walls]}, {[round(m * 1e3, 3) for m in cpus]})",
            flush=True,
        )
    write_result(
        "engine_step",
        {
            "machine": machine_info(device, dtype),
            "kernels": model.kernels,
            "prompt_tokens": PROMPT_TOKENS,
            "steps_per_sample": STEPS,
            "step_ms": results,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
