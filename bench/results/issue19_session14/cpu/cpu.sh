#!/bin/bash
# CPU seconds by process during one open-loop run of the routing workload (42 requests/s, 384 requests):
# the cluster (2 replicas, kv) against two `python -m server` routed by tenant (../no_ray/probe.py), in turns,
# ROUNDS times (default 2), plus `vmstat 1` through each run. Run from the repository root.
OUT=${OUT:-bench/results/issue19_session14/cpu}
PY=.venv/bin/python
LOAD="-m loadtest --request-rate 42 --num-requests 384 --tenants 8 --shared-prefix-tokens 256 --prompt-tokens 8
      --num-prompts 384 --max-new-tokens 32 --quiet"
wait_health() { for i in $(seq 90); do curl -sf "$1/health" > /dev/null && return; sleep 2; done; }
for r in $(seq 1 ${ROUNDS:-2}); do
  $PY -m server.cluster --checkpoint checkpoints/shakespeare-small --replicas 2 --router kv --kv-cache-memory 10MiB \
    --ray-num-cpus 2 --replica-cpus 1 --threads 1 --port 8123 > $OUT/cluster_server_$r.log 2>&1 &
  CLUSTER=$!
  wait_health http://127.0.0.1:8123; sleep 3
  vmstat 1 > $OUT/vmstat_cluster_$r.txt & VM=$!
  $PY $OUT/cpu_by_process.py -- $PY $LOAD --url http://127.0.0.1:8123 --json-out $OUT/loadtest_cluster_$r.json \
    > $OUT/cpu_cluster_$r.txt 2>&1
  kill $VM; kill -TERM $CLUSTER; wait $CLUSTER
  $PY -m server --checkpoint checkpoints/shakespeare-small --port 8124 --threads 1 --kv-cache-memory 10MiB \
    > $OUT/direct0_$r.log 2>&1 &
  D0=$!
  $PY -m server --checkpoint checkpoints/shakespeare-small --port 8125 --threads 1 --kv-cache-memory 10MiB \
    > $OUT/direct1_$r.log 2>&1 &
  D1=$!
  wait_health http://127.0.0.1:8124; wait_health http://127.0.0.1:8125; sleep 3
  vmstat 1 > $OUT/vmstat_no_ray_$r.txt & VM=$!
  URLS=http://127.0.0.1:8124,http://127.0.0.1:8125 OUT=$OUT/no_ray_$r $PY $OUT/cpu_by_process.py -- \
    $PY bench/results/issue19_session14/no_ray/probe.py tenant > $OUT/cpu_no_ray_$r.txt 2>&1
  kill $VM; kill -TERM $D0 $D1; wait $D0 $D1
done
