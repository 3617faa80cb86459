#!/bin/bash
# Run from the repository root: a cluster of 1 replica, the load tester at c=8, each thread's CPU from /proc.
OUT=${OUT:-/tmp/issue19_profile}; mkdir -p $OUT
HERE=bench/results/issue19_session9
PORT=8431
.venv/bin/python -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 1 --port $PORT --ray-num-cpus 2 --replica-cpus 1 --threads 1 > $OUT/cluster.log 2>&1 &
CL=$!
for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
sleep 2
REP=$(pgrep -f "ServeReplica:kvserve:EngineReplica" | head -1)
ING=$(pgrep -f "ServeReplica:kvserve:Ingress" | head -1)
echo "replica $REP ingress $ING"
.venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency 8 --num-requests 600 --max-new-tokens 64 --prompt-tokens 64 --quiet --json-out $OUT/prof_load.json > $OUT/prof_load.log 2>&1 &
LT=$!
sleep 4
python3 $HERE/taskcpu.py $REP 8 > $OUT/rep_cpu.txt &
P1=$!
python3 $HERE/taskcpu.py $ING 8 > $OUT/ing_cpu.txt &
P2=$!
top -b -d 8 -n 2 > $OUT/top.txt &
LTP=$(pgrep -f 'm loadtest' | head -1); python3 $HERE/taskcpu.py $LTP 8 > $OUT/lt_cpu.txt &
wait $P1 $P2
wait $LT
kill -INT $CL; wait $CL
