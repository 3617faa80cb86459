#!/bin/bash
# The routing target at 42 requests/s with the replicas' --stream-interval-ms at 20 against the default 5, in
# turns, ROUNDS times (default 2). Run from the repository root.
OUT=${OUT:-bench/results/issue19_session14/interval}
for r in $(seq 1 ${ROUNDS:-2}); do
  for ms in 20 5; do
    .venv/bin/python -m bench.cluster routing --rounds 1 --kv-cache-memory 10MiB --routers kv,pow2 \
      --request-rate 42 --num-requests 384 --cluster-flags "--stream-interval-ms $ms" --out $OUT \
      --name interval${ms}_$r > $OUT/interval${ms}_$r.log 2>&1
  done
  echo "round $r done $(date +%T)" >> $OUT/progress.log
done
