import sys, collections
path = sys.argv[1]
by_thread = collections.Counter(); leaf = collections.Counter(); frames_incl = collections.Counter()
total = 0
for line in open(path):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); total += n
    parts = stack.split(";")
    thread = parts[0]
    by_thread[thread] += n
    idle = False
    leaf[(thread[:40], parts[-1][:110])] += n
    seen = set()
    for p in parts[1:]:
        key = (thread[:40], p.split(" (")[0][:60] + " (" + p.split("(")[-1][:50])
        if key not in seen:
            frames_incl[key] += n; seen.add(key)
print("total samples", total)
for t, n in by_thread.most_common(8): print(f"{n/total*100:6.1f}% thread {t[:80]}")
print("--- leaves")
for k, n in leaf.most_common(25): print(f"{n/total*100:6.1f}% {k}")
print("--- inclusive")
for k, n in frames_incl.most_common(45): print(f"{n/total*100:6.1f}% {k}")
