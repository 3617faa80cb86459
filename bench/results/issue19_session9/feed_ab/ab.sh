#!/bin/bash
# Run from the repository root at d47edcd..beb4681 (KV_NOFEED was a local switch, never committed).
OUT=${OUT:-/tmp/issue19_feed_ab}
for i in 1 2 3; do for mode in feed nofeed; do
  if [ $mode = nofeed ]; then export KV_NOFEED=1; else unset KV_NOFEED; fi
  echo "== $mode $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/python -m bench.cluster overhead --rounds 1 --out $OUT/ab2_${mode}_$i 2>&1 | grep "^round" | sed 's/prefix: hit [0-9.]*//; s/(p50 of.*)//'
done; done
