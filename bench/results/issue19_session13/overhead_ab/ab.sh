#!/bin/bash
# The Ray path's overhead at this session's start (OLD: a worktree of 9a6b1ff) and end (NEW: this checkout),
# one round each in turns, default checkpoint: python -m bench.cluster overhead --rounds 1.
OLD=${OLD:-/tmp/old13}; NEW=${NEW:-$PWD}; OUT=${OUT:-$NEW/bench/results/issue19_session13/overhead_ab}
for i in 1 2 3; do
  for tree in old new; do
    if [ $tree = old ]; then dir=$OLD; else dir=$NEW; fi
    echo "== $tree $i $(date +%T)"
    (cd $dir && $NEW/.venv/bin/python -m bench.cluster overhead --rounds 1 --out $OUT --name ab_${tree}_$i 2>&1 \
      | grep "^round" | sed 's/prefix: hit [0-9.]*//; s/(p50 of.*)//')
  done
done
