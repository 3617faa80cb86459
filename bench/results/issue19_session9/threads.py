import sys, collections
path = sys.argv[1]
thr = collections.Counter(); thr_leaf = collections.defaultdict(collections.Counter); total = 0
for line in open(path):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); parts = stack.split(";")
    t = parts[0]; thr[t] += n
    thr_leaf[t][";".join(p.split(" (")[0] for p in parts[-3:])] += n
nsamp = max(thr.values())
for t, n in thr.most_common(12):
    print(f"{t[:60]:60s} {n}")
    for k, m in thr_leaf[t].most_common(6): print(f"      {m/n*100:5.1f}% {k[:150]}")
