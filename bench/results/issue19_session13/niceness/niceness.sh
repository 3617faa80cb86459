#!/bin/bash
# kv at 42 requests/s with the replicas' engine niceness 4 (default) and 0, one round each, in turns.
OUT=bench/results/issue19_session13/niceness
for i in 1 2 3; do
  for N in 4 0; do
    .venv/bin/python -m bench.cluster routing --rounds 1 --kv-cache-memory 10MiB --routers kv --request-rate 42 \
      --num-requests 384 --cluster-flags="--engine-niceness $N" --out $OUT --name nice${N}_$i > $OUT/nice${N}_$i.log 2>&1
    echo "nice $N round $i done $(date +%T)" >> $OUT/progress.log
  done
done
