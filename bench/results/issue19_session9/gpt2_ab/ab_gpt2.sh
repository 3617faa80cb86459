#!/bin/bash
# OLD: a worktree of e362ec5; NEW: this checkout; CKPT: python -m bench.make_checkpoint --shape gpt2.
OLD=${OLD:-/tmp/old}; NEW=${NEW:-$PWD}; CKPT=${CKPT:-/tmp/gpt2ck}; OUT=${OUT:-/tmp/issue19_gpt2_ab}
for i in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then dir=$OLD; else dir=$NEW; fi
    echo "== $tree $i $(date +%T)"
    (cd $dir && $NEW/.venv/bin/python -m bench.cluster overhead --checkpoint $CKPT --max-new-tokens 64 --num-requests 16 --rounds 1 --out $OUT/gpt2ab_${tree}_$i 2>&1 | grep "^round" | sed 's/prefix: hit [0-9.]*//; s/(p50 of.*)//')
  done
done
