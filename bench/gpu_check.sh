#!/usr/bin/env bash
# The checks that need a GPU, in one short run: bench/gpu_check.sh OUT_DIR
#   0. installs bench/gpu_requirements.txt from bench/gpu_wheels/ (no network; bench/gpu_wheels.sh fills
#      it, the device run carries it), unless they import already; the project runs from this checkout
#   1. nvidia-smi
#   2. the test suite on CUDA (KVSERVE_TEST_DEVICE=cuda; the exact-kernel tests skip there)
#   3. the offline benchmarks in float32 and bfloat16: bandwidth, cache_speedup, prefill (quick sizes)
#   4. the server under load at concurrency 1, 8 and 32 (32 requests each, prefix caching on)
# It writes 7 files into OUT_DIR: setup.log, nvidia-smi.txt, pytest_cuda.txt, bench_float32.json,
# bench_bfloat16.json, serving.json, summary.txt. Every step runs even if one fails; the exit status
# is non-zero if any did. DEVICE=cpu runs the same steps on the CPU (to check the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:?usage: bench/gpu_check.sh OUT_DIR}" && cd "$1" && pwd)
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TMP=$(mktemp -d)
status=0
step() { echo "== $1 (exit $2, $(( $(date +%s) - START ))s)" >> "$OUT/summary.txt"; [ "$2" -eq 0 ] || status=1; }
START=$(date +%s)
: > "$OUT/summary.txt"

if ! "$PY" -c "import fastapi, uvicorn, pydantic, tokenizers, safetensors, jinja2, httpx, pytest" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links bench/gpu_wheels -r bench/gpu_requirements.txt > "$OUT/setup.log" 2>&1
  step "install from bench/gpu_wheels" $?
else
  echo "the requirements import already" > "$OUT/setup.log"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  >> "$OUT/setup.log" 2>&1

{ nvidia-smi || echo "no nvidia-smi"; } > "$OUT/nvidia-smi.txt" 2>&1

KVSERVE_TEST_DEVICE=$DEVICE timeout 300 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 \
  --deselect tests/server/test_playground_browser.py > "$OUT/pytest_cuda.txt" 2>&1
step "tests on $DEVICE" $?

for dtype in float32 bfloat16; do
  for bench in bandwidth cache_speedup prefill; do
    timeout 150 "$PY" -m bench.$bench --device "$DEVICE" --dtype $dtype --quick --out "$TMP/$dtype" \
      >> "$TMP/$dtype.log" 2>&1
    step "bench.$bench $dtype" $?
  done
  "$PY" - "$TMP/$dtype" "$OUT/bench_$dtype.json" "$TMP/$dtype.log" <<'PYEOF'
import json, pathlib, sys
folder, out, log = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
merged = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}
merged["log"] = log.read_text()[-20000:] if log.exists() else ""
pathlib.Path(out).write_text(json.dumps(merged, indent=1))
PYEOF
done

timeout 240 "$PY" -m bench.serving --device "$DEVICE" --concurrency 1,8,32 --num-requests 32 --cache-modes prefix \
  --prompt-tokens 64 --max-new-tokens 128 --out "$TMP/serving" > "$TMP/serving.log" 2>&1
step "bench.serving" $?
"$PY" - "$TMP/serving/serving.json" "$OUT/serving.json" "$TMP/serving.log" <<'PYEOF'
import json, pathlib, sys
src, out, log = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
result = json.loads(src.read_text()) if src.exists() else {}
for run in result.get("runs", []):
    run.pop("requests", None)  # per-request records: too long for the one file
result["log"] = log.read_text()[-20000:] if log.exists() else ""
pathlib.Path(out).write_text(json.dumps(result, indent=1))
PYEOF
echo "total $(( $(date +%s) - START ))s, status $status" >> "$OUT/summary.txt"
rm -rf "$TMP"
exit $status
