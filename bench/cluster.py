"""The cluster's targets, measured: `python -m bench.cluster [routing|overhead]`.

- `routing`: 2 replicas (`python -m server.cluster`, one thread each), `--tenants 8` prompts with
  256-token shared prefixes, KV memory per replica for about 5 of the 8 prefixes; `--router kv`
  against `--router pow2`, in turns: prefix-cache hit rate, TTFT and tokens/s.
- `overhead`: 1 replica through `python -m server.cluster` against `python -m server` directly, at
  concurrency 1 and 8, in turns: tokens/s and the p50 inter-token latency the Ray path adds.

Each server is started afresh on a free port (the cluster with its own local Ray), driven by the
load-test tool, and stopped.
"""
from __future__ import annotations

import asyncio
import statistics

from bench.common import base_parser, machine_info, write_result
from bench.serving import running_server
from loadtest.client import LoadTestConfig, run_load_test
from loadtest.prompts import load_prompts


def _summary(run: dict) -> dict:
    return {"label": run["label"], "ok": run["requests_ok"], "failed": run["requests_failed"],
            "hit_rate": run["prefix_cache_hit_rate"], "tokens_per_s": run["output_tokens_per_s"],
            "ttft_p50_ms": 1000 * run["ttft_s"]["p50"], "ttft_p99_ms": 1000 * run["ttft_s"]["p99"],
            "itl_p50_ms": 1000 * run["itl_s"]["p50"], "itl_p99_ms": 1000 * run["itl_s"]["p99"]}


def _measure(args, module: str, flags: list[str], config: LoadTestConfig, prompts: list[str], log: str) -> list[dict]:
    with running_server(args.checkpoint, "cpu", args.dtype, args.out_dir / log, flags, module=module) as url:
        report = asyncio.run(run_load_test(LoadTestConfig(**{**config.__dict__, "url": url}), prompts))
    return [_summary(run) for run in report["runs"]]


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.cluster", __doc__)
    ap.add_argument("which", choices=["routing", "overhead"])
    ap.add_argument("--rounds", type=int, default=2, help="each variant this many times, in turns")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="12MiB", help="routing: per replica (96 blocks of 16 tokens)")
    ap.add_argument("--suffix-tokens", type=int, default=32, help="routing: each prompt's own tokens after its prefix")
    ap.add_argument("--concurrency", type=int, default=4, help="routing: closed-loop clients")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    from pathlib import Path
    from bench.common import RESULTS_DIR
    args.out_dir = Path(args.out) if args.out else RESULTS_DIR
    ray_flags = ["--ray-num-cpus", "2", "--replica-cpus", "1", "--threads", "1"]
    if args.which == "routing":
        prompts, note = load_prompts(args.num_requests, args.suffix_tokens, None, args.checkpoint, seed=0,
                                     shared_prefix_tokens=256, tenants=8)
        config = LoadTestConfig(url="", concurrency=(args.concurrency,), num_requests=args.num_requests,
                                max_new_tokens=32, request_timeout_s=300.0, timeout_s=3600.0)
        variants = {p: ("server.cluster", ["--replicas", "2", "--router", p, "--kv-cache-memory", args.kv_cache_memory,
                                           *ray_flags]) for p in ("kv", "pow2")}
    else:
        prompts, note = load_prompts(64, 32, None, args.checkpoint, seed=0)
        config = LoadTestConfig(url="", concurrency=(1, 8), num_requests=args.num_requests, max_new_tokens=64,
                                request_timeout_s=300.0, timeout_s=3600.0)
        variants = {"direct": ("server", ["--threads", "1"]),
                    "ray": ("server.cluster", ["--replicas", "1", *ray_flags])}
    results: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        for name, (module, flags) in variants.items():
            runs = _measure(args, module, flags, config, prompts, f"cluster_{args.which}_{name}_{rnd}.log")
            results[name].append(runs)
            for r in runs:
                print(f"round {rnd} {name} {r['label']}: hit {r['hit_rate']:.3f}  {r['tokens_per_s']:.0f} tok/s  "
                      f"TTFT p50 {r['ttft_p50_ms']:.1f} ms  ITL p50 {r['itl_p50_ms']:.2f} ms  ok {r['ok']}",
                      flush=True)
    medians = {name: [{key: statistics.median(rnd[i][key] for rnd in rounds) for key in rounds[0][i]
                       if isinstance(rounds[0][i][key], (int, float))} | {"label": rounds[0][i]["label"]}
                      for i in range(len(rounds[0]))] for name, rounds in results.items()}
    write_result(args.name or f"cluster_{args.which}", {"benchmark": f"cluster {args.which}",
                                                         "machine": machine_info(), "prompts": note,
                                                         "rounds": results, "medians": medians}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
