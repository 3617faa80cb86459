#!/bin/bash
# Run from the repository root. The cluster with its replicas' feeds against --no-feeds, in turns, each
# against `python -m server` in the same invocation (bench.cluster overhead, one round each).
# CHECKPOINT (default: the default checkpoint), ROUNDS (3), OUT (/tmp/issue19_ab), EXTRA (more bench flags,
# e.g. "--max-new-tokens 64 --num-requests 16" for GPT-2 small).
ROUNDS=${ROUNDS:-3}; OUT=${OUT:-/tmp/issue19_ab}; CK=${CHECKPOINT:+--checkpoint $CHECKPOINT}
for r in $(seq $ROUNDS); do
  for f in feeds nofeeds; do
    fl=""; [ $f = nofeeds ] && fl="--no-feeds"
    .venv/bin/python -m bench.cluster overhead --rounds 1 $CK $EXTRA --cluster-flags="$fl" --out $OUT \
      --name overhead_${f}_$r 2>&1 | grep '^round' | sed "s/^/$f r$r /"
  done
done
