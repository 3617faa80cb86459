#!/bin/bash
# start cluster (1 replica), load at c=8, py-spy both Serve processes
cd /work/main
PORT=8431
.venv/bin/python -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 1 --port $PORT --ray-num-cpus 2 --replica-cpus 1 --threads 1 > /tmp/mux/cluster.log 2>&1 &
CL=$!
for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
sleep 2
REP=$(pgrep -f "ServeReplica:kvserve:EngineReplica" | head -1)
ING=$(pgrep -f "ServeReplica:kvserve:Ingress" | head -1)
echo "replica $REP ingress $ING"
.venv/bin/python -m loadtest --url http://127.0.0.1:$PORT --concurrency 8 --num-requests 600 --max-new-tokens 64 --prompt-tokens 64 --quiet --json-out /tmp/mux/prof_load.json > /tmp/mux/prof_load.log 2>&1 &
LT=$!
sleep 4
python3 /tmp/mux/taskcpu.py $REP 8 > /tmp/mux/rep_cpu.txt &
P1=$!
python3 /tmp/mux/taskcpu.py $ING 8 > /tmp/mux/ing_cpu.txt &
P2=$!
top -b -d 8 -n 2 > /tmp/mux/top.txt &
LTP=$(pgrep -f 'm loadtest' | head -1); python3 /tmp/mux/taskcpu.py $LTP 8 > /tmp/mux/lt_cpu.txt &
wait $P1 $P2
wait $LT
kill -INT $CL; wait $CL
