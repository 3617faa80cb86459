#!/bin/bash
# The routing target at 42 requests/s, the replicas' weights as int8 (--quantization int8) and as float32
# (the default), in turns, ROUNDS times (default 3). Run from the repository root.
OUT=${OUT:-bench/results/issue19_session14/int8/turns}
mkdir -p $OUT
for r in $(seq 1 ${ROUNDS:-3}); do
  for q in int8 float32; do
    flags=""; [ $q = int8 ] && flags="--quantization int8"
    .venv/bin/python -m bench.cluster routing --rounds 1 --kv-cache-memory 10MiB --routers kv,pow2 \
      --request-rate 42 --num-requests 384 --server-flags "$flags" --out $OUT --name ${q}_$r > $OUT/${q}_$r.log 2>&1
  done
  echo "round $r done $(date +%T)" >> $OUT/progress.log
done
