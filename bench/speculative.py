"""Speculative decoding against plain decoding, side by side: `python -m bench.speculative`.

The engine in process (no HTTP), one thread for the kernels and one for torch, as the server runs
them with --threads 1. Closed loop at each concurrency: C requests in flight, the next one admitted
when one ends, until --requests have run. Plain and speculative engines run the same workload in
turns (plain, speculative, plain, ...), --rounds times, and the median of each is reported.

Workloads, from the held-out plays (model.data.VALIDATION_PLAYS):
- grounded: a passage twice, then its first tokens again ("continue this passage"), greedy: the
  output copies earlier text;
- open-greedy: a passage, greedy (a small model falls into its own loops);
- open-sampled: a passage, sampled at temperature 0.8 (seeded): text that rarely repeats itself.

`--served`: the same comparison through HTTP at c = 1, two `python -m server` processes (plain and
`--speculative ngram`, `--threads 1`), each request a POST /v1/completions with the prompt's token ids,
one after the other, the servers in turns.

Each run reports output tokens per second of wall time and per second of CPU time (the process's):
on a shared machine the wall clock also measures the neighbours, the CPU time much less so. The heap
is frozen after loading (gc.freeze), as the server freezes it once it is ready, so that a full
collection of the loaded model's objects does not land in one run and not the other.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from bench.common import base_parser, machine_info, resolve, write_result
from loadtest.prompts import build_prompts
from model.checkpoint import load_model, load_tokenizer
from model.data import DEFAULT_DATA_DIR, VALIDATION_PLAYS
from model.kv_cache import PagedKVCache, StepBatch
from model.sampling import SamplingParams
from server.engine import Engine, EngineConfig
from server.engine.counters import SpecDecodeCounters

WORKLOADS = ("grounded", "open-greedy", "open-sampled")


def workload_prompts(name: str, tokenizer, data_dir: Path, count: int) -> list[list[int]]:
    texts = [(data_dir / play).read_text(encoding="utf-8", errors="replace") for play in VALIDATION_PLAYS]
    if name == "grounded":
        passages = build_prompts(texts, count, 48, tokenizer, seed=1)
        return [tokenizer.encode(p + "\n\n" + p + "\n\n") + tokenizer.encode(p)[:12] for p in passages]
    return [tokenizer.encode(p) for p in build_prompts(texts, count, 64, tokenizer, seed=2)]


def params_for(name: str, max_new_tokens: int, i: int) -> SamplingParams:
    temperature = 0.8 if name == "open-sampled" else 0.0
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i, ignore_eos=True)


def step_costs(model, batches=(1, 8, 32), rows_per_sequence=(1, 2, 3, 5), repeats: int = 10) -> dict:
    """CPU ms of one forward and its logits over B sequences at context 200 with r query rows each
    (r - 1 draft tokens): the a + b * N cost model behind speculative.break_even_rate."""
    cache = PagedKVCache(model.config, max(batches) * 20 + 4, 16)
    ids = [(7 * i) % (model.config.vocab_size - 1) + 1 for i in range(220)]
    tables = [list(range(20 * s, 20 * s + 20)) for s in range(max(batches))]
    for table in tables:
        model.forward_step(StepBatch.build([(ids[:200], 0, table)], 16), cache)
    costs = {}
    for batch in batches:
        for rows in rows_per_sequence:
            step = StepBatch.build([(ids[200 : 200 + rows], 200, tables[s]) for s in range(batch)], 16)
            times = []
            for _ in range(repeats):
                start = time.process_time()
                model.compute_logits(model.forward_step(step, cache))
                times.append(time.process_time() - start)
            costs[f"B={batch} rows={rows}"] = statistics.median(times) * 1e3
            print(
                f"step cost: {batch:2d} sequences x {rows} rows: {costs[f'B={batch} rows={rows}']:.2f} ms CPU",
                flush=True,
            )
    return costs


def closed_loop(
    engine: Engine, prompts: list[list[int]], workload: str, concurrency: int, requests: int, max_new_tokens: int
) -> dict:
    """Runs `requests` requests, `concurrency` at a time, stepping the engine on this thread."""
    sinks: list[list] = []
    submitted, steps = 0, 0
    wall, cpu = time.perf_counter(), time.process_time()
    while True:
        running = [s for s in sinks if not (s and s[-1].finished)]
        while len(running) < concurrency and submitted < requests:
            sink: list = []
            engine.submit(
                prompts[submitted % len(prompts)], params_for(workload, max_new_tokens, submitted), sink.append
            )
            sinks.append(sink)
            running.append(sink)
            submitted += 1
        if not running:
            break
        engine.step()
        steps += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(1 for s in sinks for e in s if e.token_id is not None)
    return {
        "tokens": tokens,
        "steps": steps,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
    }


def served(args, tokenizer, workloads: list[str]) -> list[dict]:
    """Plain and speculative servers at c = 1, in turns: output tokens per second of wall time."""
    import httpx

    from bench.serving import running_server

    logs, flags = Path(args.out or "/tmp") / "speculative-served", ["--threads", str(args.threads)]
    spec = flags + [
        "--speculative",
        "ngram",
        "--num-speculative-tokens",
        str(args.num_speculative_tokens),
        "--ngram-history",
        str(args.ngram_history),
    ]
    runs = []
    with (
        running_server(args.checkpoint, args.device, args.dtype, logs / "plain.log", flags) as plain_url,
        running_server(args.checkpoint, args.device, args.dtype, logs / "spec.log", spec) as spec_url,
        httpx.Client(trust_env=False, timeout=600) as client,
    ):
        for workload in workloads:
            prompts = workload_prompts(workload, tokenizer, Path(args.data_dir), 64)[: args.requests or 4]
            for round_ in range(args.rounds):
                for mode, url in (("plain", plain_url), ("speculative", spec_url)):
                    tokens = accepted = 0
                    began = time.perf_counter()
                    for i, ids in enumerate(prompts):
                        p = params_for(workload, args.max_new_tokens, i)
                        usage = (
                            client.post(
                                f"{url}/v1/completions",
                                json={
                                    "prompt": ids,
                                    "max_tokens": p.max_new_tokens,
                                    "temperature": p.temperature,
                                    "seed": p.seed,
                                    "ignore_eos": True,
                                    "cache_salt": f"round-{round_}",  # no round drafts from an earlier round's outputs
                                },
                            )
                            .raise_for_status()
                            .json()["usage"]
                        )
                        tokens += usage["completion_tokens"]
                        accepted += (usage.get("completion_tokens_details") or {}).get("accepted_prediction_tokens", 0)
                    wall = time.perf_counter() - began
                    runs.append(
                        {
                            "workload": workload,
                            "mode": mode,
                            "round": round_,
                            "tokens": tokens,
                            "wall_s": wall,
                            "tokens_per_s": tokens / wall,
                            "accepted_tokens": accepted,
                        }
                    )
                    print(
                        f"served {workload:12s} c= 1 {mode:11s} round {round_}: {tokens / wall:7.1f} tok/s "
                        f"({accepted} accepted draft tokens)",
                        flush=True,
                    )
    for workload in workloads:
        median = {
            mode: statistics.median(r["tokens_per_s"] for r in runs if (r["workload"], r["mode"]) == (workload, mode))
            for mode in ("plain", "speculative")
        }
        print(f"served {workload:12s} c= 1: speculative / plain = {median['speculative'] / median['plain']:.2f}")
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.speculative", __doc__)
    ap.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="where the plays' *_gut.txt files are")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 2 x concurrency, at least 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument(
        "--ngram-history",
        type=int,
        default=EngineConfig.ngram_history,
        help="n of the n-gram history the requests share (0: off)",
    )
    ap.add_argument("--step-costs", action="store_true", help="also time a step over B sequences x r rows")
    ap.add_argument("--served", action="store_true", help="through HTTP at c = 1 instead (two server processes)")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.rounds, args.max_new_tokens = "1,2", 1, 16
    args.threads = args.threads or 1
    device, dtype = resolve(args)
    if args.served:
        runs = served(args, load_tokenizer(args.checkpoint), args.workloads.split(","))
        write_result(
            "speculative_served",
            {
                "benchmark": "speculative_served",
                "machine": machine_info(device, dtype),
                "checkpoint": args.checkpoint,
                "threads": args.threads,
                "max_new_tokens": args.max_new_tokens,
                "rounds": args.rounds,
                "num_speculative_tokens": args.num_speculative_tokens,
                "ngram_history": args.ngram_history,
                "runs": runs,
            },
            args.out,
        )
        return 0
    torch.set_num_threads(1)
    model = load_model(args.checkpoint, device=device, dtype=dtype, kernels="auto", quantization=args.quantization)
    tokenizer = load_tokenizer(args.checkpoint)
    engines = {
        "plain": Engine(model, tokenizer, threads=args.threads, max_num_seqs=64),
        "speculative": Engine(
            model,
            tokenizer,
            threads=args.threads,
            max_num_seqs=64,
            speculative="ngram",
            num_speculative_tokens=args.num_speculative_tokens,
            ngram_history=args.ngram_history,
        ),
    }
    costs = step_costs(model) if args.step_costs else None
    gc.collect()
    gc.freeze()  # as the server does once it is ready (server/api/state.py): no run pays for the loaded heap
    runs = []
    for workload in args.workloads.split(","):
        prompts = workload_prompts(workload, tokenizer, Path(args.data_dir), 64)
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            requests = args.requests or max(4, 2 * concurrency)
            for round_ in range(args.rounds):
                for mode, engine in engines.items():
                    if engine.drafter is not None and engine.drafter.history is not None:
                        engine.drafter.history.clear()  # no run drafts from an earlier run's identical requests
                    before = engine.counters().spec_decode or SpecDecodeCounters()  # None: it does not speculate
                    run = closed_loop(engine, prompts, workload, concurrency, requests, args.max_new_tokens)
                    after = engine.counters().spec_decode or SpecDecodeCounters()
                    drafted = after.num_draft_tokens - before.num_draft_tokens
                    accepted = after.num_accepted_tokens - before.num_accepted_tokens
                    run.update(
                        workload=workload,
                        concurrency=concurrency,
                        mode=mode,
                        round=round_,
                        draft_tokens=drafted,
                        accepted_tokens=accepted,
                        acceptance=accepted / drafted if drafted else None,
                    )
                    runs.append(run)
                    acceptance = "-" if run["acceptance"] is None else f"{run['acceptance']:.2f}"
                    print(
                        f"{workload:12s} c={concurrency:2d} {mode:11s} round {round_}: "
                        f"{run['tokens_per_s']:7.1f} tok/s wall, {run['tokens_per_cpu_s']:7.1f} tok/CPU-s, "
                        f"{run['tokens'] / run['steps']:.2f} tokens/step, acceptance {acceptance}",
                        flush=True,
                    )
    summary = []
    for workload in args.workloads.split(","):
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            cell = {}
            for mode in engines:
                mine = [
                    r for r in runs if (r["workload"], r["concurrency"], r["mode"]) == (workload, concurrency, mode)
                ]
                cell[mode] = {
                    key: statistics.median(r[key] for r in mine) for key in ("tokens_per_s", "tokens_per_cpu_s")
                }
            ratio = {key: cell["speculative"][key] / cell["plain"][key] for key in ("tokens_per_s", "tokens_per_cpu_s")}
            summary.append({"workload": workload, "concurrency": concurrency, **cell, "ratio": ratio})
            print(
                f"{workload:12s} c={concurrency:2d}: speculative / plain = {ratio['tokens_per_s']:.2f} (wall), "
                f"{ratio['tokens_per_cpu_s']:.2f} (CPU)",
                flush=True,
            )
    write_result(
        "speculative",
        {
            "benchmark": "speculative",
            "machine": machine_info(device, dtype),
            "checkpoint": args.checkpoint,
            "quantization": args.quantization,
            "threads": args.threads,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "num_speculative_tokens": args.num_speculative_tokens,
            "ngram_history": args.ngram_history,
            "step_costs_cpu_ms": costs,
            "summary": summary,
            "runs": runs,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
