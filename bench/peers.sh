#!/usr/bin/env bash
# bench/peers.sh PEERS_DIR OUT_DIR [ROUNDS]: this server, llama-server (f32 and f16 weights) and vLLM's
# CPU build on the default checkpoint, in turns, one at a time, each driven by `vllm bench serve`
# (random 64-token prompts, 128 new tokens, greedy) at concurrency 1, 8 and 32 (32, 64 and 128
# prompts). SERVERS="ours llama-f32" picks some. Needs ../shared/peers/setup.sh PEERS_DIR
# first (not part of this project: a measuring tool, kept out of the dependencies and of CI).
# Output tokens/s are counted by each server's own metrics (vllm bench miscounts llama-server's).
set -uo pipefail
cd "$(dirname "$0")/.."
PEERS=$(cd "${1:?usage: bench/peers.sh PEERS_DIR OUT_DIR [ROUNDS]}" && pwd)
OUT=$(mkdir -p "${2:?}" && cd "$2" && pwd)
ROUNDS=${3:-2}
SHARED=../shared/peers
counter() {  # generated tokens so far, from the server's own metrics
  case $1 in
    ours) curl -s localhost:8100/metrics | awk '/^kvserve:generation_tokens_total/ {print $2}' ;;
    llama-*) curl -s localhost:8300/metrics | awk '/^llamacpp:tokens_predicted_total/ {print $2}' ;;
    vllm) curl -s localhost:8200/metrics | awk '/^vllm:generation_tokens_total/ {s+=$2} END {print s}' ;;
  esac
}
# Each server runs in a session of its own (setsid), so that its process group holds it and whatever it
# spawns (vLLM's engine process) and nothing else: stop() ends that group, never a process found by name.
PID=
start() {
  case $1 in
    ours) setsid .venv/bin/python -m server --port 8100 --log-level warning > "$OUT/$1.log" 2>&1 &
          URL=http://127.0.0.1:8100 ;;
    llama-*) setsid bash $SHARED/serve.sh "$PEERS" "$1" 8300 > "$OUT/$1.log" 2>&1 & URL=http://127.0.0.1:8300 ;;
    vllm) setsid bash $SHARED/serve.sh "$PEERS" vllm 8200 > "$OUT/$1.log" 2>&1 & URL=http://127.0.0.1:8200 ;;
  esac
  PID=$!
  for _ in $(seq 1 600); do curl -sf "$URL/health" > /dev/null && return 0; sleep 1; done
  return 1
}
stop() {  # the server this script started last, and its children: SIGTERM, then SIGKILL after 30 s
  [ -n "$PID" ] || return 0
  kill -TERM -- "-$PID" 2>/dev/null
  for _ in $(seq 1 30); do ps -o stat= -g "$PID" | grep -qv '^Z' || break; sleep 1; done  # zombies are gone
  kill -KILL -- "-$PID" 2>/dev/null
  wait "$PID" 2>/dev/null
  PID=
}
trap stop EXIT
MODEL_OF() { case $1 in vllm) echo "$(cd checkpoints/shakespeare-small && pwd)" ;; *) echo shakespeare-small ;; esac; }
for round in $(seq 1 "$ROUNDS"); do
  for server in ${SERVERS:-ours llama-f32 llama-f16 vllm}; do
    start $server || { echo "$server did not start" >> "$OUT/summary.txt"; stop; continue; }
    for c in 1 8 32; do
      n=$(( c == 1 ? 32 : 4 * c ))
      before=$(counter $server)
      bash $SHARED/bench.sh "$PEERS" "$URL" "$(MODEL_OF $server)" $c $n "$OUT/${server}_c${c}_r${round}.json" \
        > "$OUT/${server}_c${c}_r${round}.log" 2>&1
      after=$(counter $server)
      python3 - "$OUT/${server}_c${c}_r${round}.json" "$before" "$after" "$server" "$c" "$round" >> "$OUT/summary.txt" <<'PYEOF'
import json, sys
path, before, after, server, c, rnd = sys.argv[1:]
d = json.load(open(path))
tokens = float(after) - float(before)
print(json.dumps({"server": server, "concurrency": int(c), "round": int(rnd), "output_tok_s": tokens / d["duration"],
                  "tokens": tokens, "duration_s": d["duration"], "p50_itl_ms": d["median_itl_ms"],
                  "p99_itl_ms": d["p99_itl_ms"], "p50_ttft_ms": d["median_ttft_ms"], "p99_ttft_ms": d["p99_ttft_ms"]}))
PYEOF
    done
    stop; sleep 3
  done
done
cat "$OUT/summary.txt"
