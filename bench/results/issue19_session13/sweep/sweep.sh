#!/bin/bash
# kv against pow2 at open-loop rates above section 23's, 2 replicas, 10 MiB each; in turns within each rate.
OUT=${OUT:-bench/results/issue19_session13/sweep}
for R in ${RATES:-42 48 54}; do
  .venv/bin/python -m bench.cluster routing --rounds ${ROUNDS:-2} --kv-cache-memory 10MiB --routers kv,pow2 \
    --request-rate $R --num-requests ${N:-384} --out $OUT --name rate_$R > $OUT/rate_$R.log 2>&1
  echo "rate $R done $(date +%T)" >> $OUT/progress.log
done
