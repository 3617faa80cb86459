#!/usr/bin/env bash
# bench/peers.sh [--checkpoint DIR] PEERS_DIR OUT_DIR [ROUNDS]: this server, llama-server and vLLM's CPU build
# on one checkpoint (default: checkpoints/shakespeare-small), in turns, one at a time, each driven by
# `vllm bench serve` (random 64-token prompts, 128 new tokens, greedy, ignore_eos) at each concurrency of
# LEVELS ("C:PROMPTS ...", default "1:32 8:32 32:128"). Needs ../shared/peers/setup.sh PEERS_DIR first (not
# part of this project: a measuring tool, kept out of the dependencies and of CI).
#   SERVERS   which, in order (default "ours llama-f32 llama-f16 vllm-f32"): ours, llama-f32, llama-f16,
#             llama-q8_0, vllm-f32, vllm-bf16
#   OURS_ARGS flags added to ours (e.g. "--quantization int8 --kv-cache-dtype bfloat16"); KVMEM its
#             --kv-cache-memory (default 2GiB)
#   LLAMA_BIN, LLAMA_ARGS  another llama-server build, extra flags (e.g. --no-repack)
#   MAX_LEN   the context each server is given (default the checkpoint's: GPT-2's n_positions, a family's
#             max_position_embeddings, 40,960 for Qwen3, which llama-server's 32 slots could not hold)
#   EXTRA_BODY  a JSON object added to every request (e.g. '{"structured_outputs": {"json": SCHEMA}}', which
#             vLLM and ours both read); OUTPUT_LEN new tokens a request asks for (default 128); IGNORE_EOS=0
#             lets requests end at EOS (a finished grammar allows only EOS)
# llama-server reads DIR-<type>.gguf beside the checkpoint (made by ../shared/peers/convert.py), or for the
# default checkpoint PEERS_DIR/gguf/model-<type>.gguf. Output tokens/s are counted by each server's own
# metrics (vllm bench miscounts llama-server's). Summary: OUT_DIR/summary.txt, one JSON line per run.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_CK=$(pwd)/checkpoints/shakespeare-small; CK=$DEFAULT_CK
if [ "${1:-}" = --checkpoint ]; then CK=${2:?--checkpoint DIR}; shift 2; fi
CK=$(cd "$CK" && pwd)
PEERS=$(cd "${1:?usage: bench/peers.sh [--checkpoint DIR] PEERS_DIR OUT_DIR [ROUNDS]}" && pwd)
OUT=$(mkdir -p "${2:?}" && cd "$2" && pwd)
ROUNDS=${3:-2}
NAME=$(basename "$CK")
# the context: GPT-2's n_positions, the Llama/Qwen families' max_position_embeddings
NPOS=$(python3 -c "import json, sys; c = json.load(open(sys.argv[1])); print(c.get('n_positions') or c['max_position_embeddings'])" "$CK/config.json")
NPOS=${MAX_LEN:-$NPOS}
LLAMA=$PEERS/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
gguf() {  # the GGUF file of one type (f32, f16, q8_0) of this checkpoint; fails when there is none
  if [ -f "$CK-$1.gguf" ]; then echo "$CK-$1.gguf"
  elif [ "$CK" = "$DEFAULT_CK" ] && [ -f "$PEERS/gguf/model-$1.gguf" ]; then echo "$PEERS/gguf/model-$1.gguf"
  else echo "no $CK-$1.gguf (make it with ../shared/peers/convert.py)" >&2; return 1; fi
}
counter() {  # generated tokens so far, from the server's own metrics
  case $1 in
    ours) curl -s localhost:8100/metrics | awk '/^kvserve:generation_tokens_total/ {print $2}' ;;
    llama-*) curl -s localhost:8300/metrics | awk '/^llamacpp:tokens_predicted_total/ {print $2}' ;;
    vllm-*) curl -s localhost:8200/metrics | awk '/^vllm:generation_tokens_total/ {s+=$2} END {print s}' ;;
  esac
}
# Each server runs in a session of its own (setsid), so that its process group holds it and whatever it
# spawns (vLLM's engine process) and nothing else: stop() ends that group, never a process found by name.
PID=
start() {
  case $1 in
    ours) # shellcheck disable=SC2086
      setsid .venv/bin/python -m server --checkpoint "$CK" --port 8100 --log-level warning \
        --kv-cache-memory "${KVMEM:-2GiB}" ${MAX_LEN:+--max-model-len "$MAX_LEN"} ${OURS_ARGS:-} > "$OUT/$1.log" 2>&1 &
      URL=http://127.0.0.1:8100; MODEL=$NAME ;;
    llama-*) local file; file=$(gguf "${1#llama-}") || return 1
      # shellcheck disable=SC2086
      setsid "${LLAMA_BIN:-$LLAMA}" -m "$file" ${LLAMA_ARGS:-} --host 127.0.0.1 --port 8300 -t 2 \
        -np 32 -c $((32 * NPOS)) --metrics > "$OUT/$1.log" 2>&1 &
      URL=http://127.0.0.1:8300; MODEL=$NAME ;;
    vllm-*) dtype=${1#vllm-}; [ "$dtype" = f32 ] && dtype=float32; [ "$dtype" = bf16 ] && dtype=bfloat16
      VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 setsid "$PEERS/vllm/bin/vllm" \
        serve "$CK" --host 127.0.0.1 --port 8200 --dtype "$dtype" --max-model-len "$NPOS" > "$OUT/$1.log" 2>&1 &
      URL=http://127.0.0.1:8200; MODEL=$CK ;;
    *) echo "unknown server $1" >&2; return 1 ;;
  esac
  PID=$!
  for _ in $(seq 1 600); do
    curl -sf "$URL/health" > /dev/null && return 0
    kill -0 "$PID" 2>/dev/null || return 1  # it died while starting: its log says why
    sleep 1
  done
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
load() {  # vllm bench serve: concurrency, prompts, result file, seed (each level its own prompts)
  local extra=(--disable-tqdm); case $URL in *:8300) extra+=(--header Connection=close) ;; esac
  [ "${IGNORE_EOS:-1}" = 0 ] || extra+=(--ignore-eos)
  [ -z "${EXTRA_BODY:-}" ] || extra+=(--extra-body "$EXTRA_BODY")
  rm -f "$3"  # never read a result an earlier run left
  "$PEERS/vllm/bin/vllm" bench serve --backend openai --base-url "$URL" --endpoint /v1/completions --model "$MODEL" \
    --tokenizer "$CK" --dataset-name random --random-input-len 64 --random-output-len "${OUTPUT_LEN:-128}" \
    --temperature 0 --max-concurrency "$1" --num-prompts "$2" --seed "$4" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --result-dir "$OUT" \
    --result-filename "$(basename "$3")" "${extra[@]}"
}
for round in $(seq 1 "$ROUNDS"); do
  for server in ${SERVERS:-ours llama-f32 llama-f16 vllm-f32}; do
    start "$server" || { echo "{\"server\": \"$server\", \"round\": $round, \"error\": \"did not start\"}" >> "$OUT/summary.txt"; stop; continue; }
    load 4 8 "$OUT/${server}_warmup_r${round}.json" $((1000 * round)) > /dev/null 2>&1
    for level in ${LEVELS:-1:32 8:32 32:128}; do
      c=${level%:*}; n=${level#*:}
      before=$(counter "$server")
      load "$c" "$n" "$OUT/${server}_c${c}_r${round}.json" $((1000 * round + c)) > "$OUT/${server}_c${c}_r${round}.log" 2>&1
      after=$(counter "$server")
      python3 - "$OUT/${server}_c${c}_r${round}.json" "$before" "$after" "$server" "$c" "$round" \
        "$(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/summary.txt" <<'PYEOF'
import json, sys
path, before, after, server, c, rnd, load = sys.argv[1:]
try:
    d = json.load(open(path))
    tokens = float(after) - float(before)
except (OSError, ValueError) as e:  # no result, or the server's counter did not answer
    print(json.dumps({"server": server, "concurrency": int(c), "round": int(rnd), "error": str(e)}))
    sys.exit()
print(json.dumps({"server": server, "concurrency": int(c), "round": int(rnd), "output_tok_s": round(tokens / d["duration"], 1),
                  "tokens": tokens, "duration_s": d["duration"], "p50_itl_ms": d["median_itl_ms"],
                  "p99_itl_ms": d["p99_itl_ms"], "p50_ttft_ms": d["median_ttft_ms"], "p99_ttft_ms": d["p99_ttft_ms"],
                  "load_average_1m": float(load)}))
PYEOF
    done
    stop; sleep 3
  done
done
cat "$OUT/summary.txt"
