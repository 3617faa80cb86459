"""Open loop (Poisson, RATE/s) or C clients against a 2-replica cluster (or a direct server): for hits and misses,
the client's TTFT p50 beside the engine's own (`details.time_to_first_token_s`) and its queue time.
python probe.py ROUTER|direct [extra server flags]; env RATE (0: closed loop of C clients), N, C."""
import asyncio, json, os, random, statistics, sys, tempfile, time
from pathlib import Path
import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository
from bench.serving import running_server
from loadtest.prompts import load_prompts

CK = "checkpoints/shakespeare-small"  # run from the repository root
N, C, RATE = int(os.environ.get("N", "256")), int(os.environ.get("C", "1")), float(os.environ.get("RATE", "0"))
prompts, _ = load_prompts(N, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
router, extra = sys.argv[1], sys.argv[2:]
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
                    REC.append((x["cached_tokens"], 1000 * first, 1000 * x["time_to_first_token_s"],
                                1000 * x["queue_time_s"]))


async def main(url):
    async with httpx.AsyncClient(trust_env=False, timeout=60, limits=httpx.Limits(max_connections=256)) as client:
        for p in prompts[:8]:
            await one(client, url, p)
        REC.clear()
        if RATE:
            rng, tasks = random.Random(0), []
            for p in prompts:
                tasks.append(asyncio.create_task(one(client, url, p)))
                await asyncio.sleep(rng.expovariate(RATE))
            await asyncio.gather(*tasks)
        else:
            it = iter(prompts)
            async def worker():
                for p in it:
                    await one(client, url, p)
            await asyncio.gather(*(worker() for _ in range(C)))

if router == "direct":
    module, flags = "server", ["--threads", "1", "--kv-cache-memory", "10MiB", *extra]
else:
    module, flags = "server.cluster", ["--replicas", "2", "--router", router, "--kv-cache-memory", "10MiB",
                                       "--ray-num-cpus", "2", "--replica-cpus", "1", "--threads", "1", *extra]
with running_server(CK, "cpu", "float32", Path(tempfile.gettempdir()) / f"probe_{router}.log", flags,
                    module=module) as url:
    asyncio.run(main(url))
hits = [r for r in REC if r[0] > 0]; miss = [r for r in REC if r[0] == 0]
for name, rs in (("all", REC), ("hit", hits), ("miss", miss)):
    if rs:
        print(router, f"rate={RATE} c={C}", name, len(rs), "client TTFT p50 %.1f" % statistics.median(r[1] for r in rs),
              "engine TTFT p50 %.1f" % statistics.median(r[2] for r in rs),
              "queue p50 %.1f" % statistics.median(r[3] for r in rs), flush=True)
