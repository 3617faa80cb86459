"""The routing target's pairs from `python -m bench.cluster routing` JSON files: per round, kv against pow2.
python ratios.py FILE.json [...]"""
import json
import statistics
import sys

print("| file | req/s | kv hit | kv TTFT p50 | kv hits' p50 | pow2 hit | pow2 requests hitting | pow2 TTFT p50 "
      "| pow2 hits' p50 | ratio | tok/s kv / pow2 |")
ratios = []
for path in sys.argv[1:]:
    d = json.load(open(path))
    rate = d["machine"]["argv"][d["machine"]["argv"].index("--request-rate") + 1]
    for kv, p2 in zip(d["rounds"]["kv"], d["rounds"]["pow2"]):
        kv, p2 = kv[0], p2[0]
        ratio = kv["ttft_p50_ms"] / p2["ttft_p50_ms"]
        ratios.append(ratio)
        print(f"| {path.split('/')[-1]} | {rate} | {kv['hit_rate']:.3f} | {kv['ttft_p50_ms']:.1f} | "
              f"{kv['ttft_hit_p50_ms']:.1f} | {p2['hit_rate']:.3f} | {p2['requests_hitting']:.2f} | "
              f"{p2['ttft_p50_ms']:.1f} | {p2['ttft_hit_p50_ms']:.1f} | {ratio:.2f} | "
              f"{kv['tokens_per_s']:.0f} / {p2['tokens_per_s']:.0f} |")
print(f"median ratio {statistics.median(ratios):.2f} of {len(ratios)} rounds; "
      f"at or below 0.5 in {sum(r <= 0.5 for r in ratios)}")
