#!/bin/bash
# kv with --imbalance-threshold 4 and T in turns, 8 closed-loop clients, 10 MiB a replica.
OUT=${OUT:-/tmp/s12_c8}; T=${T:-8}
for r in $(seq ${ROUNDS:-3}); do
  for t in 4 $T; do
    .venv/bin/python -m bench.cluster routing --rounds 1 --kv-cache-memory 10MiB --routers kv --concurrency 8 \
      --cluster-flags="--imbalance-threshold $t" --out $OUT --name t${t}_$r > $OUT/t${t}_$r.log 2>&1
    echo "t$t $r: $(grep '^round' $OUT/t${t}_$r.log | cut -c1-170) | $(grep -o 'outcome="[a-z]*"}=[0-9]*' $OUT/t${t}_$r.log | tr '\n' ' ')"
  done
done
