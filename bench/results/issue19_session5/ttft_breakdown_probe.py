"""c=4 closed loop against a 2-replica cluster (or direct server): client TTFT vs the engine's, hits vs misses."""
import sys, time, json, statistics, asyncio, httpx
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from pathlib import Path
from bench.serving import running_server
from loadtest.prompts import load_prompts
CK = "checkpoints/shakespeare-small"  # run from the repository root
import os
prompts, note = load_prompts(int(os.environ.get("N", "128")), 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
router = sys.argv[1]
extra = sys.argv[2:]
REC = []
async def one(client, url, p):
    body = {"inputs": p, "parameters": {"max_new_tokens": 32, "details": True}}
    t0 = time.perf_counter(); first = None
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                first = first or time.perf_counter() - t0
                d = json.loads(line[5:])
                if d.get("details"):
                    x = d["details"]
                    REC.append((x["cached_tokens"], 1000 * first, 1000 * x["time_to_first_token_s"], 1000 * x["queue_time_s"]))
async def main(url):
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        await one(client, url, prompts[0])
        it = iter(prompts)
        async def worker():
            for p in it:
                await one(client, url, p)
        await asyncio.gather(*(worker() for _ in range(int(os.environ.get("C", "4")))))
if router == "direct":
    module, flags = "server", ["--threads", "1", "--kv-cache-memory", "10MiB", *extra]
else:
    module, flags = "server.cluster", ["--replicas", "2", "--router", router, "--kv-cache-memory", "10MiB",
                                       "--ray-num-cpus", "2", "--replica-cpus", "1", "--threads", "1", *extra]
with running_server(CK, "cpu", "float32", Path(__import__("tempfile").gettempdir()) / f"c4_{router}.log", flags, module=module) as url:
    asyncio.run(main(url))
hits = [r for r in REC[1:] if r[0] > 0]; miss = [r for r in REC[1:] if r[0] == 0]
for name, rs in (("all", REC[1:]), ("hit", hits), ("miss", miss)):
    if rs:
        print(router, name, len(rs), "client TTFT p50 %.1f" % statistics.median(r[1] for r in rs),
              "engine TTFT p50 %.1f" % statistics.median(r[2] for r in rs), "queue p50 %.1f" % statistics.median(r[3] for r in rs))
