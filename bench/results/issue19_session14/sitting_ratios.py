"""The sitting's table (sitting.sh): per round, the TTFT p50 ratio of the two policies without Ray (tenant /
least) and through the cluster (kv / pow2). python sitting_ratios.py [DIR]"""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/issue19_session14/sitting")
print("| round | no Ray: tenant hit, TTFT p50 | least hit, TTFT p50 | ratio | cluster: kv hit, TTFT p50 "
      "| pow2 hit, TTFT p50 | ratio | tok/s (no Ray, cluster) |")
print("|---:|---|---|---:|---|---|---:|---|")
no_ray, cluster = [], []
for r in range(1, 100):
    nr_file, cl_file = out / f"no_ray_{r}" / "no_ray_42.json", out / f"cluster_{r}.json"
    if not nr_file.is_file() or not cl_file.is_file():
        continue
    nr = {d["policy"]: d for d in json.loads(nr_file.read_text())}
    rounds = json.loads(cl_file.read_text())["rounds"]
    kv, p2 = rounds["kv"][0][0], rounds["pow2"][0][0]
    a, b = nr["tenant"]["ttft_p50_ms"] / nr["least"]["ttft_p50_ms"], kv["ttft_p50_ms"] / p2["ttft_p50_ms"]
    no_ray.append(a)
    cluster.append(b)
    print(f"| {r} | {nr['tenant']['hit_rate']:.3f}, {nr['tenant']['ttft_p50_ms']:.1f} | "
          f"{nr['least']['hit_rate']:.3f}, {nr['least']['ttft_p50_ms']:.1f} | {a:.2f} | "
          f"{kv['hit_rate']:.3f}, {kv['ttft_p50_ms']:.1f} | {p2['hit_rate']:.3f}, {p2['ttft_p50_ms']:.1f} | {b:.2f} | "
          f"{nr['tenant']['tokens_per_s']:.0f}-{nr['least']['tokens_per_s']:.0f}, "
          f"{kv['tokens_per_s']:.0f}-{p2['tokens_per_s']:.0f} |")
print(f"median ratio without Ray {statistics.median(no_ray):.2f} (at or below 0.5 in {sum(x <= 0.5 for x in no_ray)} "
      f"of {len(no_ray)}); through the cluster {statistics.median(cluster):.2f} ({sum(x <= 0.5 for x in cluster)} "
      f"of {len(cluster)})")
