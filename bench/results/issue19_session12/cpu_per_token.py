"""CPU per streamed token: python3 cpu_per_token.py LOAD_JSON LABEL NAME=TICKS_BEFORE:TICKS_AFTER ...
(LOAD_JSON: `python -m loadtest --json-out`; ticks: utime + stime from /proc/PID/stat, 100 a second)."""
import json
import sys


def summary(x):
    """The load test's run summary: the first dict with its token counts."""
    if isinstance(x, dict):
        if "output_tokens" in x and "output_tokens_per_s" in x:
            return x
        x = list(x.values())
    if isinstance(x, list):
        for y in x:
            found = summary(y)
            if found:
                return found
    return None


load, label, *processes = sys.argv[1:]
s = summary(json.load(open(load)))
parts = [f"{label}: tok/s {s['output_tokens_per_s']:.0f} tokens {s['output_tokens']}"]
for p in processes:
    name, ticks = p.split("=")
    before, after = map(int, ticks.split(":"))
    seconds = (after - before) / 100
    parts.append(f"{name} {seconds:.2f}s ms/token {seconds * 1000 / s['output_tokens']:.3f}")
print(" ".join(parts))
