"""The routing target's workload without Ray: two `python -m server` processes (one thread, 10 MiB of KV each),
routed by this client. `tenant`: each tenant's prompts go to one server (tenants alternate between them, what
`kv` routing converges to); `least`: the server with fewer requests in flight, ties at random (what Serve's
`pow2` picks among two replicas, with exact counts instead of its probes). Poisson arrivals, the prompts of
`python -m bench.cluster routing` (8 tenants, 256-token prefixes, 8-token suffixes, 32 new tokens).
Run from the repository root: python probe.py tenant,least [ROUNDS]; env RATE (default 42), N (384), OUT,
URLS (two servers already running, comma-separated, instead of starting them)."""
import asyncio, contextlib, json, os, random, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository
from bench.serving import running_server
from loadtest.client import RequestParams, make_client, stream_one
from loadtest.prompts import load_prompts
from loadtest.report import RequestRecord, summarize

CK = "checkpoints/shakespeare-small"
N, RATE = int(os.environ.get("N", "384")), float(os.environ.get("RATE", "42"))
OUT = Path(os.environ.get("OUT", "/tmp/no_ray"))
FLAGS = ["--threads", "1", "--kv-cache-memory", "10MiB"]
prompts, _ = load_prompts(N, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
prompts = prompts[:N]
prefixes = sorted({p[:400] for p in prompts})
tenant_of = [prefixes.index(p[:400]) for p in prompts]


async def run(urls, policy):
    """`run_workload`'s open loop (the same arrivals, client and records), each request sent to the server
    that `policy` picks."""
    rng, records, in_flight, tasks = random.Random(0), [], [0, 0], []
    params = RequestParams(max_new_tokens=32)

    async def send(i, k):
        record = RequestRecord(start=time.perf_counter())
        records.append(record)
        in_flight[k] += 1
        try:
            await stream_one(client, urls[k], prompts[i], params, record)
        finally:
            in_flight[k] -= 1

    async with make_client(120.0) as client:
        for url in urls:  # warm each server, as the load tester's probe does (not recorded)
            await stream_one(client, url, prompts[0], RequestParams(max_new_tokens=4), RequestRecord(start=0.0))
        begin = arrival = time.perf_counter()
        pick = random.Random(1)
        for i in range(len(prompts)):
            arrival += rng.expovariate(RATE)
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            if policy == "tenant":
                k = tenant_of[i] % 2
            else:
                k = pick.randrange(2) if in_flight[0] == in_flight[1] else min((0, 1), key=in_flight.__getitem__)
            tasks.append(asyncio.create_task(send(i, k)))
        await asyncio.gather(*tasks)
    wall = max(r.end for r in records) - begin
    s = summarize(records, wall)
    return {"policy": policy, "ok": s["requests_ok"], "hit_rate": s["prefix_cache_hit_rate"],
            "requests_hitting": sum((r.cached_tokens or 0) > 0 for r in records) / len(records),
            "ttft_p50_ms": 1000 * s["ttft_s"]["p50"], "tokens_per_s": s["output_tokens_per_s"],
            "load_1min": os.getloadavg()[0]}


def main():
    policies, rounds = sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 1
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for rnd in range(rounds):
        for policy in policies:
            with contextlib.ExitStack() as stack:  # fresh servers: empty caches for every run
                urls = os.environ["URLS"].split(",") if os.environ.get("URLS") else [  # or servers already running
                    stack.enter_context(running_server(CK, "cpu", "float32", OUT / f"server{k}.log", FLAGS))
                    for k in range(2)]
                r = asyncio.run(run(urls, policy)) | {"round": rnd, "rate": RATE}
            results.append(r)
            print(json.dumps(r), flush=True)
    (OUT / f"no_ray_{int(RATE)}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
