"""CPU seconds each process spent while a command ran: python cpu_by_process.py -- COMMAND...
Sampled every 0.25 s (a process that ends is counted to its last sample). Prints the processes that
used more than 0.05 s, by name (Ray's processes by their title), largest first."""
import os, subprocess, sys, time

TICK = os.sysconf("SC_CLK_TCK")


def snapshot():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            name = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:90] or stat.split()[1]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


before, t0 = snapshot(), time.time()
child, after = subprocess.Popen(sys.argv[sys.argv.index("--") + 1:]), {}
while child.poll() is None:  # sampled, so that processes that end before the command does are counted
    after.update(snapshot())
    time.sleep(0.25)
after.update(snapshot())
wall = time.time() - t0
rows = sorted(((cpu - before.get(pid, (None, 0.0))[1], name, pid) for pid, (name, cpu) in after.items()),
              reverse=True)
total = sum(r[0] for r in rows if r[0] > 0)
print(f"wall {wall:.1f} s, CPU {total:.1f} s ({total / wall:.2f} cores)")
for cpu, name, pid in rows:
    if cpu > 0.05:
        print(f"{cpu:7.2f} s  {pid:>7}  {name}")
