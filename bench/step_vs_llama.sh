#!/usr/bin/env bash
# bench/step_vs_llama.sh PEERS_DIR OUT_DIR [OLD_TREE]: the batch-1/8/32 decode step (bench.bandwidth)
# and llama.cpp's `llama-bench -n 128` (f32, 2 threads) on the default checkpoint, in turns, two rounds;
# with OLD_TREE (a checkout of an older commit, e.g. `git worktree add /tmp/old e43ea9c`), that
# tree's bench.bandwidth --compile too. Needs ../shared/peers/setup.sh PEERS_DIR first.
set -u
cd "$(dirname "$0")/.."
PEERS=$(cd "${1:?usage: bench/step_vs_llama.sh PEERS_DIR OUT_DIR [OLD_TREE]}" && pwd)
OUT=$(mkdir -p "${2:?}" && cd "$2" && pwd)
OLD=${3:-}
PY=$(pwd)/.venv/bin/python
LLAMA_BENCH=$(find "$PEERS/llama" -path '*build/bin/llama-bench' | head -1)
for round in 1 2; do
  $PY -m bench.bandwidth --out "$OUT/new_r$round" > "$OUT/new_r$round.log" 2>&1
  [ -n "$OLD" ] && (cd "$OLD" && $PY -m bench.bandwidth --compile --out "$OUT/old_r$round" > "$OUT/old_r$round.log" 2>&1)
  "$LLAMA_BENCH" -m "$PEERS/gguf/model-f32.gguf" -n 128 -p 0 -t 2 -r 5 > "$OUT/llama_r$round.log" 2>&1
done
grep -h "decode step\|t/s\|tg128\|bandwidth" "$OUT"/*.log
