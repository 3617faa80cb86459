#!/bin/bash
# Run from the repository root: CPU per thread (from /proc) at concurrency C (1) for the cluster (MODE=ray)
# or `python -m server` (MODE=direct), default checkpoint, one kernel thread, the load-test client.
OUT=${OUT:-/tmp/issue19_cpu}; PORT=8431; C=${C:-1}; MODE=${MODE:-ray}; T=bench/results/issue19_session9/taskcpu.py
mkdir -p $OUT
if [ $MODE = ray ]; then
  .venv/bin/python -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 1 --port $PORT \
    --ray-num-cpus 2 --replica-cpus 1 --threads 1 > $OUT/server.log 2>&1 &
else
  .venv/bin/python -m server --checkpoint checkpoints/shakespeare-small --port $PORT --threads 1 > $OUT/server.log 2>&1 &
fi
SRV=$!
for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
sleep 2
.venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency $C --num-requests 400 --max-new-tokens 64 \
  --prompt-tokens 64 --quiet --json-out $OUT/load_$MODE$C.json > $OUT/load.log 2>&1 &
LT=$!
sleep 3
if [ $MODE = ray ]; then
  python3 $T $(pgrep -f "ServeReplica:kvserve:EngineReplica" | head -1) 6 > $OUT/replica.txt &
  python3 $T $(pgrep -f "ServeReplica:kvserve:Ingress" | head -1) 6 > $OUT/ingress.txt &
else
  python3 $T $SRV 6 > $OUT/replica.txt &
fi
python3 $T $LT 6 > $OUT/client.txt &
wait %3 %4 2>/dev/null; sleep 7
kill $LT 2>/dev/null; wait $LT
kill -INT $SRV; wait $SRV
cat $OUT/replica.txt $OUT/ingress.txt $OUT/client.txt 2>/dev/null
