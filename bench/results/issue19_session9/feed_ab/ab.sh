#!/bin/bash
cd /work/main
for i in 1 2 3; do for mode in feed nofeed; do
  if [ $mode = nofeed ]; then export KV_NOFEED=1; else unset KV_NOFEED; fi
  echo "== $mode $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/python -m bench.cluster overhead --rounds 1 --out /tmp/mux/ab2_${mode}_$i 2>&1 | grep "^round" | sed 's/prefix: hit [0-9.]*//; s/(p50 of.*)//'
done; done
