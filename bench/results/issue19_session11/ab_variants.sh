#!/bin/bash
# Run from the repository root: cluster variants (VARIANTS: names; FLAGS_<name>: their cluster flags), in
# turns, each against `python -m server` in the same invocation. ROUNDS (2), OUT, CHECKPOINT, EXTRA.
# ENV_<name>: environment for that variant ("X=1" for none). Prints Ray / direct tokens/s, the ITL p50 the Ray path
# adds, ITL p99 and TTFT p50 (Ray / direct) at concurrency 1 and 8.
ROUNDS=${ROUNDS:-2}; OUT=${OUT:-/tmp/issue19_s11}; CK=${CHECKPOINT:+--checkpoint $CHECKPOINT}
for r in $(seq $ROUNDS); do
  for v in $VARIANTS; do
    fl=FLAGS_$v
    en=ENV_$v; env ${!en} .venv/bin/python -m bench.cluster overhead --rounds 1 $CK $EXTRA --cluster-flags="${!fl}" \
      --out $OUT --name overhead_${v}_$r > /dev/null 2>&1
    python3 bench/results/issue19_session11/ratios.py "$OUT/overhead_${v}_$r.json"
  done
done
