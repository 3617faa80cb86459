#!/usr/bin/env bash
# The checks that need a GPU, in one go: bench/gpu_check.sh OUT_DIR [CHECKPOINT]
#   1. the test suite on CUDA (KVSERVE_TEST_DEVICE=cuda is passed through to pytest)
#   2. every benchmark with --device cuda, in float32 and in bfloat16
# Results land in OUT_DIR: pytest_cuda.txt, float32/*.json, bfloat16/*.json (and their logs).
# Set QUICK=1 for smoke-sized benchmarks. Runs every step even if one fails; exits non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR [CHECKPOINT]}
CHECKPOINT=${2:-checkpoints/shakespeare-small}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
QUICK_FLAG=$([ "${QUICK:-0}" = 1 ] && echo --quick || true)
mkdir -p "$OUT"
status=0

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
  > "$OUT/device.txt" 2>&1 || { cat "$OUT/device.txt"; exit 2; }

KVSERVE_TEST_DEVICE=cuda "$PYTHON" -m pytest -q 2>&1 | tee "$OUT/pytest_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

for dtype in float32 bfloat16; do
  "$PYTHON" -m bench.run_all --device cuda --dtype "$dtype" --checkpoint "$CHECKPOINT" --out "$OUT/$dtype" \
    $QUICK_FLAG 2>&1 | tee "$OUT/bench_$dtype.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
