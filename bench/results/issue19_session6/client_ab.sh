# A/B of the load tester's HTTP client against one direct server, in turns. Run from the repository root:
#   git worktree add "$OLD_TREE" <the commit before aiohttp> && OLD_TREE=... bash bench/results/issue19_session6/client_ab.sh
source .venv/bin/activate
python -m server --checkpoint checkpoints/shakespeare-small --port 8811 --threads 1 --kv-cache-memory 20MiB > "${TMPDIR:-/tmp}/srv.log" 2>&1 &
PID=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:8811/health >/dev/null && break; sleep 1; done
for rnd in 1 2 3; do for tree in "$OLD_TREE" "$PWD"; do for c in 4 16; do
  python bench/results/issue19_session6/client_cpu.py "$tree" http://127.0.0.1:8811 $c 2>&1 | grep client
done; done; done
kill $PID; wait $PID
