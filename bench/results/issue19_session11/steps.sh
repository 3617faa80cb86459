#!/bin/bash
# Run from the repository root: the engine's steps under load at concurrency C (8), MODE=ray|direct:
# steps, decode rows per step, step time, from /metrics before and after the load.
PORT=8434; C=${C:-8}; MODE=${MODE:-ray}; OUT=${OUT:-/tmp/issue19_steps}; mkdir -p $OUT
if [ $MODE = ray ]; then
  .venv/bin/python -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 1 --port $PORT \
    --ray-num-cpus 2 --replica-cpus 1 --threads 1 $CLUSTER_FLAGS > $OUT/server_$MODE.log 2>&1 &
else
  .venv/bin/python -m server --checkpoint checkpoints/shakespeare-small --port $PORT --threads 1 > $OUT/server_$MODE.log 2>&1 &
fi
SRV=$!
for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done; sleep 2
m() { curl -s localhost:$PORT/metrics | grep -E '^kvserve:(step_tokens_(sum|count)\{.*decode|step_duration_seconds_(sum|count)|step_tokens_sum\{.*prompt)' | sed 's/{.*}//' ; }
m > $OUT/before_$MODE.txt
.venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency $C --num-requests 300 --max-new-tokens 64 \
  --prompt-tokens 64 2>&1 | grep -E "tok/s|Output tokens/s|TTFT p50" | head -3
m > $OUT/after_$MODE.txt
kill -INT $SRV; wait $SRV
paste $OUT/before_$MODE.txt $OUT/after_$MODE.txt | awk '{printf "%s %.4f\n", $1, $4-$2}'
