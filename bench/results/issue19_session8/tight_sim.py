"""2 simulated replicas of 80 blocks, 8 uniform tenants (256-token prefixes, 8-token suffixes), Poisson at
30/60/90 requests/s, 6 seeds: `python tight_sim.py [REPO]` (REPO: a checkout whose router to run)."""
import sys, random, statistics
from pathlib import Path
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[3]))
from bench.routing_sim import Trace, simulate, CostModel

def trace(seed, n=512, rate=30.0, tenants=8, prefix=256, suffix=8, out=32):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(prefix)] for _ in range(tenants)]
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        k = rng.randrange(tenants)
        reqs.append((t, k, prefixes[k] + [rng.randrange(50_000) for _ in range(suffix)]))
    return Trace(reqs, out)

cost = CostModel(0.0008, 0.0003, 0.0001)
for rate in (30, 60, 90):
    for policy in ("kv",):
        res = [simulate(trace(s, rate=rate), policy, 2, cost=cost, num_blocks=80, block_size=16, max_num_seqs=128,
                        max_batched=512, report_interval=1.0, imbalance_threshold=4, seed=s) for s in range(6)]
        print(rate, policy, "hit %.3f" % statistics.median(r.hit_rate for r in res),
              "ttft p50 %.1f" % statistics.median(r.ttft_p50_ms for r in res),
              "p99 %.1f" % statistics.median(r.ttft_p99_ms for r in res),
              [round(r.hit_rate, 2) for r in res], [r.fallbacks for r in res], flush=True)
