import sys, random, statistics, os, functools
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from bench.routing_sim import Trace, simulate, CostModel
import bench.routing_sim as rs
from server.engine.block_manager import BlockManager
if os.environ.get('SHARE'):
    rs.BlockManager = functools.partial(BlockManager, protected_share=float(os.environ['SHARE']))

def trace(seed, n=256, rate=15.0, prefix=256, suffix=8, out=32, phases=((0,1,2,3),(4,5,6,7))):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(prefix)] for _ in range(8)]
    t, reqs = 0.0, []
    for phase in phases:
        for _ in range(n):
            t += rng.expovariate(rate)
            k = rng.choice(phase)
            reqs.append((t, k, prefixes[k] + [rng.randrange(50_000) for _ in range(suffix)]))
    return Trace(reqs, out)
cost = CostModel(0.0008, 0.0003, 0.0001)
for name, phases, n in (("shift 4->4", ((0,1,2,3),(4,5,6,7)), 256), ("shift fast", ((0,1,2,3),(4,5,6,7),(0,1,2,3),(4,5,6,7)), 32),
                     ("steady 4", ((0,1,2,3),), 512), ("steady 6", ((0,1,2,3,4,5),), 512), ("steady 8", ((0,1,2,3,4,5,6,7),), 512)):
    res = [simulate(trace(s, n=n, phases=phases), "pow2", 1, cost=cost, num_blocks=80, block_size=16, max_num_seqs=128,
                    max_batched=512, report_interval=1.0, imbalance_threshold=4, seed=s) for s in range(5)]
    print(os.environ.get("SHARE", "old"), name, "hit %.3f" % statistics.median(r.hit_rate for r in res), [round(r.hit_rate, 3) for r in res])
