"""The cluster's targets, measured: `python -m bench.cluster [routing|overhead]`.

- `routing`: 2 replicas (`python -m server.cluster`, one thread each), `--tenants 8` prompts with
  256-token shared prefixes and short suffixes of their own, KV memory per replica for about 5 of the 8
  prefixes; `--router kv`, `pow2` and `round-robin` in turns: prefix-cache hit rate beside the
  workload's ceiling, TTFT and tokens/s. The ceiling is the hit rate of one cache that never evicts:
  every full block of a prompt but the one holding its last token, if an earlier prompt (the load
  tester's probe included) had the same blocks before it. 4 clients in a closed loop, or `--request-rate R`
  (Poisson arrivals: every policy serves the same tokens/s while it keeps up). Each run also reports the
  TTFT p50 of the requests that hit the cache and of those that missed.
- `overhead`: 1 replica through `python -m server.cluster` against `python -m server` directly, at
  concurrency 1 and 8, in turns: tokens/s and the p50 inter-token latency the Ray path adds
  (`--with-proxy` adds the cluster behind Ray Serve's HTTP proxy, `--serve-proxy`, as a third variant).
  `--client vllm` drives it with `vllm bench serve` (random 64-token prompts on /v1/completions, greedy,
  ignore_eos) instead of our load-test tool.

Each server is started afresh on a free port (the cluster with its own local Ray), warmed with a few
requests, driven, and stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
from pathlib import Path

import httpx

from bench.common import base_parser, machine_info, write_result
from bench.serving import running_server
from loadtest.client import LoadTestConfig, run_load_test
from loadtest.prompts import load_prompts


def _summary(run: dict) -> dict:
    """One run's figures; with the TTFT p50 of the requests that hit the prefix cache and of those that
    missed it (None where there were none), since a policy's median request is a hit once over half hit."""
    ok = [r for r in run.get("requests", []) if r["ok"] and r["cached_tokens"] is not None and r["ttft_s"] is not None]
    hits = [1000 * r["ttft_s"] for r in ok if r["cached_tokens"] > 0]
    misses = [1000 * r["ttft_s"] for r in ok if r["cached_tokens"] == 0]
    return {
        "label": run["label"],
        "ok": run["requests_ok"],
        "failed": run["requests_failed"],
        "hit_rate": run["prefix_cache_hit_rate"],
        "tokens_per_s": run["output_tokens_per_s"],
        "ttft_p50_ms": _in_ms(run["ttft_s"]["p50"]),
        "ttft_p99_ms": _in_ms(run["ttft_s"]["p99"]),
        "ttft_mean_ms": _in_ms(run["ttft_s"]["mean"]),
        "ttft_p90_ms": _in_ms(run["ttft_s"]["p90"]),
        "itl_p50_ms": _in_ms(run["itl_s"]["p50"]),
        "itl_p99_ms": _in_ms(run["itl_s"]["p99"]),
        "requests_hitting": len(hits) / len(ok) if ok else 0.0,
        "ttft_hit_p50_ms": statistics.median(hits) if hits else None,
        "ttft_miss_p50_ms": statistics.median(misses) if misses else None,
    }


def _in_ms(seconds: float | None) -> float | None:
    """None for a run with no request to measure (all failed): recorded as such, not a crash of the rounds."""
    return None if seconds is None else 1000 * seconds


def _median_of(values: list) -> float | None:
    """The median of the rounds' figures that exist (None: none did)."""
    present = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(present) if present else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def hit_rate_ceiling(prompts: list[str], tokenizer_dir: str, block_size: int = 16) -> float:
    """The most of the prompts' tokens any prefix cache could serve, sent in order after the load tester's
    probe (prompts[0]): see the module's docstring."""
    from model.checkpoint import load_tokenizer
    from server.engine.block_manager import extend_block_keys

    tokenizer = load_tokenizer(Path(tokenizer_dir))
    seen: set[int] = set()
    hit = total = 0
    for i, text in enumerate([prompts[0], *prompts]):
        ids = tokenizer.encode(text)
        keys = extend_block_keys([], ids, block_size, None, len(ids) // block_size)
        if i:  # the probe only warms the cache
            cacheable = keys[: (len(ids) - 1) // block_size]
            hit += block_size * next((n for n, k in enumerate(cacheable) if k not in seen), len(cacheable))
            total += len(ids)
        seen.update(keys)
    return hit / total


VLLM = Path("/root/peers/vllm/bin/vllm")  # the peers' venv (/work/shared/peers/README.md)


def _measure(args, module: str, flags: list[str], config: LoadTestConfig, prompts: list[str], log: str) -> list[dict]:
    with running_server(args.checkpoint, "cpu", args.dtype, args.out_dir / log, flags, module=module) as url:
        if args.client == "vllm":
            _vllm_bench(args, url, 4, 8, "warmup")
            return [
                _vllm_bench(args, url, c, n, f"{log[:-4]}_c{c}") for c, n in zip(config.concurrency, args.vllm_prompts)
            ]
        report = asyncio.run(run_load_test(LoadTestConfig(**{**config.__dict__, "url": url}), prompts))
        routing = _routing_counts(url) if module == "server.cluster" else {}
    return [_summary(run) | routing for run in report["runs"]]


ROUTING_METRICS = (
    "kvserve:router_decisions_total",
    "kvserve:replica_prefix_cache_hits_total",
    "kvserve:replica_prefix_cache_queries_total",
)


def _routing_counts(url: str) -> dict:
    """The cluster's router decisions by outcome and each replica's prefix-cache counters, from its
    /metrics as the run ends (all of a run's requests: the load tester's probe included)."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(ROUTING_METRICS):
            name, value = line.rsplit(" ", 1)
            counts[name.removeprefix("kvserve:")] = float(value)
    return {"routing_counts": counts}


def _vllm_bench(args, url: str, concurrency: int, prompts: int, name: str) -> dict:
    """One `vllm bench serve` run against the server at `url`: its summary in our keys."""
    model = httpx.get(url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    out = args.out_dir / "cluster_vllm"
    out.mkdir(parents=True, exist_ok=True)
    command = [
        str(VLLM),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(args.checkpoint),
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        str(args.max_new_tokens),
        "--ignore-eos",
        "--temperature",
        "0",
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(prompts),
        "--seed",
        "0",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{name}.json",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=1800)
    d = json.loads((out / f"{name}.json").read_text())
    return {
        "label": f"c={concurrency}",
        "ok": d["completed"],
        "failed": d["num_prompts"] - d["completed"],
        "hit_rate": 0.0,
        "tokens_per_s": d["output_throughput"],
        "ttft_p50_ms": d["median_ttft_ms"],
        "ttft_p99_ms": d["p99_ttft_ms"],
        "ttft_mean_ms": d["mean_ttft_ms"],
        "itl_p50_ms": d["median_itl_ms"],
        "itl_p99_ms": d["p99_itl_ms"],
        "requests_hitting": 0.0,
        "ttft_hit_p50_ms": None,
        "ttft_miss_p50_ms": None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.cluster", __doc__)
    ap.add_argument("which", choices=["routing", "overhead"])
    ap.add_argument("--rounds", type=int, default=2, help="each variant this many times, in turns")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="12MiB", help="routing: per replica (96 blocks of 16 tokens)")
    ap.add_argument("--suffix-tokens", type=int, default=8, help="routing: each prompt's own tokens after its prefix")
    ap.add_argument("--concurrency", type=int, default=4, help="routing: closed-loop clients")
    ap.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="routing: an open loop instead, Poisson arrivals at this many requests/s (every policy "
        "then serves the same tokens/s while it keeps up)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64, help="overhead: per request")
    ap.add_argument(
        "--client",
        choices=["loadtest", "vllm"],
        default="loadtest",
        help="overhead: our load-test tool or `vllm bench serve`",
    )
    ap.add_argument("--vllm-prompts", default="16,32", help="overhead, --client vllm: prompts at c=1 and at c=8")
    ap.add_argument(
        "--with-proxy",
        action="store_true",
        help="overhead: also the cluster behind Ray Serve's HTTP proxy (--serve-proxy)",
    )
    ap.add_argument("--routers", default="kv,pow2,round-robin", help="routing: the policies compared")
    ap.add_argument(
        "--server-flags", default="", help="more flags for every server started (e.g. '--engine-niceness 0')"
    )
    ap.add_argument("--cluster-flags", default="", help="more flags for the cluster only (e.g. '--no-feeds')")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    args.vllm_prompts = [int(n) for n in args.vllm_prompts.split(",")]
    from bench.common import RESULTS_DIR

    args.out_dir = Path(args.out) if args.out else RESULTS_DIR
    ray_flags = [
        "--ray-num-cpus",
        "2",
        "--replica-cpus",
        "1",
        "--threads",
        "1",
        *args.server_flags.split(),
        *args.cluster_flags.split(),
    ]
    if args.which == "routing":
        prompts, note = load_prompts(
            args.num_requests, args.suffix_tokens, None, args.checkpoint, seed=0, shared_prefix_tokens=256, tenants=8
        )
        prompts = prompts[: args.num_requests]  # sent once each, in order
        note["hit_rate_ceiling"] = ceiling = hit_rate_ceiling(prompts, args.checkpoint)
        print(
            f"workload: {len(prompts)} prompts, {note.get('tokens_mean', 0):.0f} tokens on average; "
            f"hit-rate ceiling {ceiling:.3f}",
            flush=True,
        )
        config = LoadTestConfig(
            url="",
            concurrency=(args.concurrency,),
            num_requests=args.num_requests,
            request_rates=(args.request_rate,) if args.request_rate else (),
            max_new_tokens=32,
            request_timeout_s=300.0,
            timeout_s=3600.0,
            duration_s=3600.0,
        )
        variants = {
            p: (
                "server.cluster",
                ["--replicas", "2", "--router", p, "--kv-cache-memory", args.kv_cache_memory, *ray_flags],
            )
            for p in args.routers.split(",")
        }
    else:
        prompts, note = load_prompts(64, 32, None, args.checkpoint, seed=0)
        config = LoadTestConfig(
            url="",
            concurrency=(1, 8),
            num_requests=args.num_requests,
            max_new_tokens=args.max_new_tokens,
            request_timeout_s=300.0,
            timeout_s=3600.0,
        )
        variants = {
            "direct": ("server", ["--threads", "1", *args.server_flags.split()]),
            "ray": ("server.cluster", ["--replicas", "1", *ray_flags]),
        }
        if args.with_proxy:
            variants["ray-proxy"] = ("server.cluster", ["--replicas", "1", "--serve-proxy", *ray_flags])
    results: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        for name, (module, flags) in variants.items():
            runs = _measure(args, module, flags, config, prompts, f"cluster_{args.which}_{name}_{rnd}.log")
            load = os.getloadavg()[0]  # the machine is shared: its 1-minute load, read as the run ends
            results[name].append([r | {"load_1min": load} for r in runs])
            for r in runs:
                print(
                    f"round {rnd} {name} {r['label']}: hit {r['hit_rate']:.3f}  {r['tokens_per_s']:.0f} tok/s  "
                    f"TTFT p50 {_ms(r['ttft_p50_ms'])} mean {_ms(r['ttft_mean_ms'])} ms (p50 of the "
                    f"{r['requests_hitting']:.0%} hitting {_ms(r['ttft_hit_p50_ms'])}, of the rest "
                    f"{_ms(r['ttft_miss_p50_ms'])})  "
                    f"ITL p50 {'-' if r['itl_p50_ms'] is None else format(r['itl_p50_ms'], '.2f')} ms  "
                    f"ok {r['ok']}  load {load:.1f}",
                    flush=True,
                )
                if r.get("routing_counts"):
                    print("   " + "  ".join(f"{k}={v:g}" for k, v in r["routing_counts"].items()), flush=True)
    medians = {
        name: [
            {
                key: _median_of([rnd[i][key] for rnd in rounds])
                for key in rounds[0][i]
                if key not in ("label", "routing_counts")
            }
            | {"label": rounds[0][i]["label"]}
            for i in range(len(rounds[0]))
        ]
        for name, rounds in results.items()
    }
    write_result(
        args.name or f"cluster_{args.which}",
        {
            "benchmark": f"cluster {args.which}",
            "client": args.client,
            "server_flags": args.server_flags,
            "cluster_flags": args.cluster_flags,
            "checkpoint": str(args.checkpoint),
            "machine": machine_info(),
            "prompts": note,
            "rounds": results,
            "medians": medians,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
