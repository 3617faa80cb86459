import sys, random, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from bench.routing_sim import Trace, simulate, CostModel
import bench.routing_sim as rs

def trace(seed, n=512, rate=30.0, tenants=8, prefix=256, suffix=8, out=32):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(prefix)] for _ in range(tenants)]
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        k = rng.randrange(tenants)
        reqs.append((t, k, prefixes[k] + [rng.randrange(50_000) for _ in range(suffix)]))
    return Trace(reqs, out)

import os, functools
from server.engine.block_manager import BlockManager
if os.environ.get('SHARE'):
    rs.BlockManager = functools.partial(BlockManager, protected_share=float(os.environ['SHARE']))
cost = CostModel(0.0008, 0.0003, 0.0001)
for blocks in map(int, sys.argv[1].split(",")):
    for policy in ("kv", "oracle", "pow2"):
        res = [simulate(trace(s), policy, 2, cost=cost, num_blocks=blocks, block_size=16, max_num_seqs=128,
                        max_batched=512, report_interval=1.0, imbalance_threshold=4, seed=s) for s in range(6)]
        print(blocks, policy, "hit %.3f" % statistics.median(r.hit_rate for r in res),
              "ttft p50 %.1f" % statistics.median(r.ttft_p50_ms for r in res), [round(r.hit_rate, 2) for r in res])
