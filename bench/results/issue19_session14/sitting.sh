#!/bin/bash
# In turns, rounds FIRST to LAST (1 to 3) at RATE requests/s: the routing workload on two plain
# `python -m server` processes routed by the client (no_ray/probe.py: tenant, least), then through the
# cluster (kv, pow2).
# Run from the repository root. OUT: where the files go.
OUT=${OUT:-bench/results/issue19_session14/sitting}
RATE=${RATE:-42}
mkdir -p $OUT
for r in $(seq ${FIRST:-1} ${LAST:-3}); do
  RATE=$RATE OUT=$OUT/no_ray_$r .venv/bin/python bench/results/issue19_session14/no_ray/probe.py tenant,least \
    > $OUT/no_ray_$r.log 2>&1
  .venv/bin/python -m bench.cluster routing --rounds 1 --kv-cache-memory 10MiB --routers kv,pow2 \
    --request-rate $RATE --num-requests 384 --out $OUT --name cluster_$r > $OUT/cluster_$r.log 2>&1
  echo "round $r done $(date +%T)" >> $OUT/progress.log
done
