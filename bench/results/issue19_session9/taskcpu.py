"""CPU per thread of a process over an interval: python taskcpu.py PID SECONDS"""
import os, sys, time
pid, secs = int(sys.argv[1]), float(sys.argv[2])
def snap():
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            f = stat[stat.rindex(")") + 2:].split()
            out[tid] = (name, int(f[11]) + int(f[12]))
        except OSError: pass
    return out
a = snap(); time.sleep(secs); b = snap()
tick = os.sysconf("SC_CLK_TCK")
rows = sorted(((b[t][1] - a.get(t, (0, 0))[1]) / tick / secs, b[t][0], t) for t in b)
tot = sum(r[0] for r in rows)
print(f"pid {pid}: {tot*100:.0f}% total")
for cpu, name, tid in reversed(rows[-8:]):
    if cpu > 0.005: print(f"   {cpu*100:5.1f}%  {name} ({tid})")
