#!/bin/bash
# kv with --imbalance-threshold 4 (the default) and T, and pow2, in turns at 27 requests/s, 10 MiB a replica.
OUT=${OUT:-/tmp/s12_thr}; T=${T:-12}
for r in $(seq ${ROUNDS:-3}); do
  for v in t4 t$T pow2; do
    case $v in t4) R=kv; F="--imbalance-threshold 4";; pow2) R=pow2; F="";; *) R=kv; F="--imbalance-threshold $T";; esac
    .venv/bin/python -m bench.cluster routing --rounds 1 --kv-cache-memory 10MiB --routers $R --request-rate 27 \
      --num-requests 256 --cluster-flags="$F" --out $OUT --name ${v}_$r > $OUT/${v}_$r.log 2>&1
    echo "$v $r: $(grep '^round' $OUT/${v}_$r.log | cut -c1-150) | $(grep -o 'outcome="[a-z]*"}=[0-9]*' $OUT/${v}_$r.log | tr '\n' ' ')"
  done
done
