import sys, asyncio
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from pathlib import Path
from bench.serving import running_server
from bench.cluster import _summary
from loadtest.client import LoadTestConfig, run_load_test
from loadtest.prompts import load_prompts
CK = "checkpoints/shakespeare-small"
prompts, note = load_prompts(128, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
prompts = prompts[:128]
for rnd in range(2):
    for rate in (3.0, 12.0):
        with running_server(CK, "cpu", "float32", Path(__import__("tempfile").gettempdir()) / "direct.log", ["--threads", "1", "--kv-cache-memory", "20MiB"]) as url:
            cfg = LoadTestConfig(url=url, request_rates=(rate,), num_requests=128, max_new_tokens=32, request_timeout_s=300.0, timeout_s=3600.0)
            rep = asyncio.run(run_load_test(cfg, prompts))
        s = _summary(rep["runs"][0])
        print(rnd, rate, "hit %.3f ttft p50 %.1f mean %.1f tok/s %.0f itl %.2f" % (s["hit_rate"], s["ttft_p50_ms"], s["ttft_mean_ms"], s["tokens_per_s"], s["itl_p50_ms"]), flush=True)
