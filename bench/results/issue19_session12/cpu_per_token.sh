#!/bin/bash
# CPU seconds of the cluster's ingress (and replica) per streamed token at concurrency C, variants in turns.
# VARIANTS names; ENV_<name> its environment. Run from the repository root.
# The "nojoin" variant ran with a local switch in server/api/sse.py guarded() (KVSERVE_NO_JOIN), not committed.
OUT=${OUT:-/tmp/s12_cpu}; PORT=8431; C=${C:-8}; ROUNDS=${ROUNDS:-3}; mkdir -p $OUT
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
for r in $(seq $ROUNDS); do for v in $VARIANTS; do
  en=ENV_$v
  env ${!en} .venv/bin/python -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 1 --port $PORT \
    --ray-num-cpus 2 --replica-cpus 1 --threads 1 $CLUSTER_FLAGS > $OUT/server_$v$r.log 2>&1 &
  SRV=$!
  for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done; sleep 2
  ING=$(pgrep -f "ServeReplica:kvserve:Ingress" | head -1); REP=$(pgrep -f "ServeReplica:kvserve:EngineReplica" | head -1)
  i0=$(cpu $ING); r0=$(cpu $REP)
  .venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency $C --num-requests 400 --max-new-tokens 64 \
    --prompt-tokens 64 --quiet --json-out $OUT/load_$v$r.json > $OUT/load_$v$r.log 2>&1
  i1=$(cpu $ING); r1=$(cpu $REP)
  python3 bench/results/issue19_session12/cpu_per_token.py $OUT/load_$v$r.json "$v round $r" ingress=$i0:$i1 replica=$r0:$r1
  kill -INT $SRV; wait $SRV
done; done
