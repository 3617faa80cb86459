"""One load-test run from the tree on sys.path[0] (argv[1]) against argv[2]; prints CPU per token."""
import sys, os, time, asyncio, json
sys.path.insert(0, sys.argv[1])
from loadtest.client import LoadTestConfig, run_load_test
from loadtest.prompts import load_prompts
import loadtest.client as lc
CK = "checkpoints/shakespeare-small"  # run from the repository root
prompts, _ = load_prompts(128, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
cfg = LoadTestConfig(url=sys.argv[2], concurrency=(int(sys.argv[3]),), num_requests=128, max_new_tokens=32, request_timeout_s=120, timeout_s=600)
c0 = os.times(); t0 = time.time()
rep = asyncio.run(run_load_test(cfg, prompts))
c1 = os.times(); wall = time.time() - t0
r = rep["runs"][0]
cpu = c1.user - c0.user + c1.system - c0.system
print(f"{'aiohttp' if 'aiohttp' in lc.__dict__ else 'httpx'} c={sys.argv[3]} ok={r['requests_ok']} tokens={r['output_tokens']} client CPU {cpu:.2f}s = {1000*cpu/r['output_tokens']:.3f} ms/token, {cpu/wall:.2f} cores; tok/s {r['output_tokens_per_s']:.0f} TTFT p50 {1000*r['ttft_s']['p50']:.1f} ITL p50 {1000*r['itl_s']['p50']:.2f}", flush=True)
