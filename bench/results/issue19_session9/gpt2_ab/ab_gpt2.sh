#!/bin/bash
for i in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then dir=/tmp/old; else dir=/work/main; fi
    echo "== $tree $i $(date +%T)"
    (cd $dir && /work/main/.venv/bin/python -m bench.cluster overhead --checkpoint /tmp/gpt2ck --max-new-tokens 64 --num-requests 16 --rounds 1 --out /tmp/mux/gpt2ab_${tree}_$i 2>&1 | grep "^round" | sed 's/prefix: hit [0-9.]*//; s/(p50 of.*)//')
  done
done
