#!/bin/bash
# kv against pow2 at rising open-loop rates, 2 replicas, 10 MiB each; in turns within each rate.
for R in ${RATES:-30 33 36}; do
  .venv/bin/python -m bench.cluster routing --rounds ${ROUNDS:-2} --kv-cache-memory 10MiB --routers kv,pow2 \
    --request-rate $R --num-requests ${N:-256} --out ${OUT:-/tmp/s12_sweep} --name rate_$R > ${OUT:-/tmp/s12_sweep}/rate_$R.log 2>&1
  echo "rate $R done $(date +%T)"
done
