#!/bin/bash
# Run from the repository root: at concurrency C (1), py-spy on the cluster's replica, one of
#   PROFILE=gil     which thread holds Python's lock (py-spy --gil), or
#   PROFILE=native  every thread's native stack (pauses the process per sample: indicative only)
# CLUSTER_FLAGS: more flags for the cluster (e.g. "--stream-interval-ms 5", session 11)
OUT=${OUT:-/tmp/issue19_gil}; PORT=8431; C=${C:-1}; PROFILE=${PROFILE:-gil}
mkdir -p $OUT
.venv/bin/python -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 1 --port $PORT \
  --ray-num-cpus 2 --replica-cpus 1 --threads 1 $CLUSTER_FLAGS > $OUT/server.log 2>&1 &
SRV=$!
for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
sleep 2
REP=$(pgrep -f "ServeReplica:kvserve:EngineReplica" | head -1)
.venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency $C --num-requests 400 --max-new-tokens 64 \
  --prompt-tokens 64 --quiet > $OUT/load.log 2>&1 &
LT=$!
sleep 3
if [ $PROFILE = gil ]; then
  .venv/bin/py-spy record -p $REP -r 200 -d 8 --threads --gil --nonblocking -f raw -o $OUT/replica_gil.txt
else
  .venv/bin/py-spy record -p $REP -r 100 -d 8 --threads --native -f raw -o $OUT/replica_native.txt
fi
kill $LT 2>/dev/null; wait $LT
kill -INT $SRV; wait $SRV
