"""A/B of server env/flags: kv router, c=4, httpx client; variants in turns, fresh cluster each run.
The two variants tried with it read environment hooks that were added for the runs and not committed:
KVS_SER (the handle's request/response serialization, in RayEngineClient) and KVS_SWITCH
(sys.setswitchinterval in EngineReplica.__init__)."""
import sys, time, json, statistics, asyncio, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
import httpx
from pathlib import Path
from bench.serving import running_server
from loadtest.prompts import load_prompts
CK = "checkpoints/shakespeare-small"  # run from the repository root
prompts, note = load_prompts(128, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
C = int(os.environ.get("C", "4"))
async def one(client, url, p, rec):
    body = {"inputs": p, "parameters": {"max_new_tokens": 32, "details": True, "ignore_eos": True}}
    t0 = time.perf_counter(); first = None
    async with client.stream("POST", url + "/generate_stream", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                first = first or time.perf_counter() - t0
                d = json.loads(line[5:])
                if d.get("details"):
                    rec.append((d["details"]["cached_tokens"], 1000 * first, 1000 * d["details"]["time_to_first_token_s"]))
async def run(url):
    rec = []
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        await one(client, url, prompts[0], [])
        it = iter(prompts)
        async def worker():
            for p in it:
                await one(client, url, p, rec)
        t0 = time.time()
        await asyncio.gather(*(worker() for _ in range(C)))
        wall = time.time() - t0
    hits = [r for r in rec if r[0] > 0]
    return dict(n=len(rec), hit=len(hits) / len(rec), ttft=statistics.median(r[1] for r in rec),
                eng=statistics.median(r[2] for r in hits), tok_s=32 * len(rec) / wall)
variants = {}
for v in sys.argv[1:]:  # name=ENV:VAL,ENV2:VAL|flag flag
    name, spec = v.split("=", 1)
    env_part, _, flag_part = spec.partition("|")
    env = dict(kv.split(":", 1) for kv in env_part.split(",") if kv)
    variants[name] = (env, flag_part.split())
rounds = int(os.environ.get("ROUNDS", "3")); router = os.environ.get("ROUTER", "kv")
for rnd in range(rounds):
    for name, (env, extra) in variants.items():
        old = {k: os.environ.get(k) for k in env}; os.environ.update(env)
        flags = ["--replicas", "2", "--router", router, "--kv-cache-memory", "10MiB",
                 "--ray-num-cpus", "2", "--replica-cpus", "1", "--threads", "1", *extra]
        with running_server(CK, "cpu", "float32", Path(__import__("tempfile").gettempdir()) / f"ab_{name}.log", flags, module="server.cluster") as url:
            r = asyncio.run(run(url))
        for k, val in old.items():
            if val is None: os.environ.pop(k, None)
            else: os.environ[k] = val
        print(name, rnd, " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), "load %.1f" % os.getloadavg()[0], flush=True)
