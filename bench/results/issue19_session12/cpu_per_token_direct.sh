#!/bin/bash
# CPU seconds of `python -m server` per streamed token at concurrency C (the cluster's figure's counterpart).
OUT=${OUT:-/tmp/s12_cpu}; PORT=8432; C=${C:-8}; ROUNDS=${ROUNDS:-2}; mkdir -p $OUT
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
for r in $(seq $ROUNDS); do
  .venv/bin/python -m server --checkpoint checkpoints/shakespeare-small --port $PORT --threads 1 $FLAGS > $OUT/direct$r.log 2>&1 &
  SRV=$!
  for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done; sleep 2
  s0=$(cpu $SRV)
  .venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency $C --num-requests 400 --max-new-tokens 64 \
    --prompt-tokens 64 --quiet --json-out $OUT/load_direct$r.json > /dev/null 2>&1
  s1=$(cpu $SRV)
  python3 bench/results/issue19_session12/cpu_per_token.py $OUT/load_direct$r.json "direct round $r" server=$s0:$s1
  kill -INT $SRV; wait $SRV
done
