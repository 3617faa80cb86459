"""Routing at scales we cannot run here, on paper with our own code: `python -m bench.routing_sim`.

A synthetic multi-tenant trace (Zipf-distributed tenants, each with a shared system prompt of 256-1024
tokens, then a unique suffix; Poisson arrivals) is replayed against N simulated replicas. Each replica
runs the real `Scheduler` and `BlockManager` of `server/engine/`; only the model is replaced, by a cost
model of a step's time (a fixed part, a part per decode row, a part per prompt token), whose defaults
come from the figures measured on the default checkpoint (BENCHMARKS.md: the decode step, prompts). Requests
are routed by the real `server.cluster.router.Router`, fed by the replicas' periodic reports
(`report_from`), exactly as in the Ray Serve app. The `oracle` policy is `kv` reading every replica's
prefix cache as it is at the moment of each decision, instead of the last report.

Reports, per policy and replica count: the prefix-cache hit rate (cached prompt tokens over prompt
tokens, vLLM's definition), TTFT p50 and p99, and the load imbalance (the busiest replica's busy time
over the mean).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from model.sampling import SamplingParams
from server.cluster.router import Router, report_from
from server.engine.block_manager import BlockManager
from server.engine.request import Request
from server.engine.scheduler import Scheduler
from server.engine.step_budget import StepBudget

POLICIES = ("kv", "oracle", "pow2", "round-robin")


@dataclass(frozen=True)
class CostModel:
    """Seconds a step takes on one replica, from its shape."""

    step_s: float  # fixed: the engine's bookkeeping and the batch-1 weights pass
    decode_row_s: float  # each decode row beyond that
    prompt_token_s: float  # each prompt token computed

    def step(self, decode_rows: int, prompt_tokens: int) -> float:
        return self.step_s + self.decode_row_s * decode_rows + self.prompt_token_s * prompt_tokens


@dataclass(frozen=True)
class Trace:
    """The workload: (arrival time, tenant, prompt token ids), in arrival order."""

    requests: list[tuple[float, int, list[int]]]
    output_tokens: int


def make_trace(num_requests: int, rate: float, tenants: int, zipf_s: float, output_tokens: int, seed: int) -> Trace:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randint(256, 1024))] for _ in range(tenants)]
    weights = [1 / (k + 1) ** zipf_s for k in range(tenants)]
    t, requests = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(tenants), weights)[0]
        suffix = [rng.randrange(50_000) for _ in range(rng.randint(16, 64))]
        requests.append((t, tenant, prefixes[tenant] + suffix))
    return Trace(requests, output_tokens)


class SimReplica:
    def __init__(self, rid: str, num_blocks: int, block_size: int, max_num_seqs: int, max_batched: int) -> None:
        self.rid = rid
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, StepBudget(max_batched), max_num_seqs=max_num_seqs, max_waiting=10**9)
        self.busy = False
        self.busy_s = 0.0


@dataclass
class PolicyResult:
    policy: str
    replicas: int
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    ttft_p50_ms: float
    ttft_p99_ms: float
    imbalance: float  # busiest replica's busy time / the mean
    fallbacks: int  # kv: requests sent to the least loaded replica instead of the cached one
    wall_s: float  # how long the simulation itself took


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def simulate(
    trace: Trace,
    policy: str,
    num_replicas: int,
    *,
    cost: CostModel,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_batched: int,
    report_interval: float,
    imbalance_threshold: int,
    seed: int,
) -> PolicyResult:
    started = time.perf_counter()
    replicas = {
        f"r{i}": SimReplica(f"r{i}", num_blocks, block_size, max_num_seqs, max_batched) for i in range(num_replicas)
    }
    router = Router(
        "kv" if policy == "oracle" else policy,
        block_size,
        imbalance_threshold=imbalance_threshold,
        seed=seed,
        clock=lambda: now,
    )
    router.set_replicas(list(replicas))
    if policy == "oracle":  # the router's picture of each cache is the cache itself, live
        for rid, rep in replicas.items():
            router.replicas[rid].held = rep.blocks.cached  # type: ignore[assignment]
    events: list[tuple[float, int, str, object]] = []  # (time, tiebreak, kind, payload)
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for i, (t, _, _) in enumerate(trace.requests):
        push(t, "arrive", i)
    if policy in ("kv", "pow2"):
        push(report_interval, "report", None)
    arrival: dict[Request, float] = {}
    routed_to: dict[Request, str] = {}
    ttft: list[float] = []
    params = SamplingParams(max_new_tokens=trace.output_tokens, temperature=0)
    token_rng = random.Random(seed + 1)
    now, pending = 0.0, len(trace.requests)

    def start_step(rep: SimReplica) -> None:
        sched = rep.scheduler.schedule()
        decode_rows = sum(1 for r, n in sched.num_tokens.items() if n == 1 and r.num_computed >= r.num_prompt_tokens)
        dt = cost.step(decode_rows, sum(sched.num_tokens.values()) - decode_rows)
        rep.busy, rep.busy_s = True, rep.busy_s + dt
        push(now + dt, "step", (rep, sched))

    while pending:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            _, _, prompt = trace.requests[payload]
            req = Request(prompt, params, 0, lambda out: None)
            decision = router.choose(prompt)
            rep = replicas[decision.replica_id]
            arrival[req], routed_to[req] = now, rep.rid
            rep.scheduler.add_all([req])
            if not rep.busy:
                start_step(rep)
        elif kind == "report":
            for rep in replicas.values():
                router.report(report_from(rep.rid, rep.blocks, rep.scheduler.num_running, rep.scheduler.num_waiting))
            push(now + report_interval, "report", None)
        else:
            rep, sched = payload
            for req, n in sched.num_tokens.items():  # the engine's update, with a made-up token
                if req.finished:
                    continue
                sampled = req.num_computed + n == req.num_tokens  # the step reached its last token
                req.num_computed += n
                rep.blocks.register_full_blocks(req)
                if sampled:
                    if req.num_output_tokens == 0:
                        ttft.append(now - arrival[req])
                    req.token_ids.append(token_rng.randrange(50_000))
                    if req.num_output_tokens >= trace.output_tokens:
                        rep.scheduler.finish(req)
                        router.finished(routed_to.pop(req))
                        pending -= 1
            rep.busy = False
            if rep.scheduler.has_work():
                start_step(rep)
    queries = sum(r.scheduler.stats.prefix_cache_queries for r in replicas.values())
    hits = sum(r.scheduler.stats.prefix_cache_hits for r in replicas.values())
    busy = [r.busy_s for r in replicas.values()]
    return PolicyResult(
        policy,
        num_replicas,
        len(trace.requests),
        hits / max(queries, 1),
        1000 * _pct(ttft, 0.5),
        1000 * _pct(ttft, 0.99),
        max(busy) / (sum(busy) / len(busy)),
        router.decisions[("kv", "fallback")],
        time.perf_counter() - started,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="4,16,64,256", help="comma-separated replica counts")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests-per-replica", type=int, default=40)
    ap.add_argument("--rate-per-replica", type=float, default=6.0, help="Poisson arrivals, requests/s per replica")
    ap.add_argument("--tenants-per-replica", type=float, default=12.0)
    ap.add_argument("--zipf", type=float, default=1.0, help="tenant popularity exponent")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica (the default 128 MiB)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--report-interval", type=float, default=0.5, help="seconds between replica reports")
    ap.add_argument("--imbalance-threshold", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=0.8, help="fixed cost of a step (BENCHMARKS.md, the decode step)")
    ap.add_argument("--decode-row-ms", type=float, default=0.3, help="cost of each decode row (the decode step)")
    ap.add_argument("--prompt-token-ms", type=float, default=0.1, help="cost of each prompt token (prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/routing_sim.json"))
    args = ap.parse_args(argv)
    cost = CostModel(args.step_ms / 1000, args.decode_row_ms / 1000, args.prompt_token_ms / 1000)
    results = []
    print("| replicas | tenants | policy | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | imbalance | fallbacks |")
    print("|---:|---:|:--|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in args.replicas.split(",")]:
        tenants = max(1, round(args.tenants_per_replica * n))
        trace = make_trace(
            args.requests_per_replica * n, args.rate_per_replica * n, tenants, args.zipf, args.output_tokens, args.seed
        )
        for policy in args.policies.split(","):
            r = simulate(
                trace,
                policy,
                n,
                cost=cost,
                num_blocks=args.num_blocks,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs,
                max_batched=args.max_num_batched_tokens,
                report_interval=args.report_interval,
                imbalance_threshold=args.imbalance_threshold,
                seed=args.seed,
            )
            results.append(asdict(r) | {"tenants": tenants})
            print(
                f"| {n} | {tenants} | {policy} | {r.hit_rate:.3f} | {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | "
                f"{r.imbalance:.2f} | {r.fallbacks} |",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
