"""Where the Ray path's time to first token goes at concurrency 1: python3 analyze.py trace.txt
(trace.txt: `rid tag wall-time` lines written by trace.py, patched in by trace_patch.diff; the first 10
requests skipped as warm-up)."""
import collections
import statistics
import sys

events = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    rid, tag, t = line.split()
    events[rid].setdefault(tag, float(t))
tags = ["I0_start", "R0_entry", "R1_submitted", "I1_taken", "R2_first_queued", "I2_first"]
full = [e for e in events.values() if all(t in e for t in tags)][10:]
print(f"{len(full)} requests")
for a, b in zip(tags, tags[1:]):
    d = sorted((e[b] - e[a]) * 1000 for e in full)
    print(f"{a:>16} -> {b:<16} p50 {statistics.median(d):6.2f} ms  p90 {d[int(len(d) * .9)]:6.2f}")
for a, b in (("R1_submitted", "R2_first_queued"), ("I0_start", "I2_first")):
    print(f"{a} -> {b}: p50 {statistics.median((e[b] - e[a]) * 1000 for e in full):.2f} ms")
