#!/bin/bash
# kv (default threshold, now 8) against pow2 in turns: 8 and 4 closed-loop clients, then 27 requests/s; 10 MiB a replica.
OUT=${OUT:-/tmp/s12_t8}
B=".venv/bin/python -m bench.cluster routing --rounds 3 --kv-cache-memory 10MiB --routers kv,pow2 --out $OUT"
$B --concurrency 8 --name c8 > $OUT/c8.log 2>&1; echo "c8 done $(date +%T)"
$B --concurrency 4 --name c4 > $OUT/c4.log 2>&1; echo "c4 done $(date +%T)"
$B --request-rate 27 --num-requests 256 --name rate27 > $OUT/rate27.log 2>&1; echo "rate27 done $(date +%T)"
