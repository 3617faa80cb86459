#!/usr/bin/env bash
# gen.sh OUT ROUND VARIANT... : each variant's server in turn under `vllm bench serve` (random 64-token prompts,
# 128 out, greedy, ignore_eos), one summary line per level in OUT/summary.txt.
# env: CK (checkpoint), LEVELS "c:n ..." (concurrency:prompts), FLAGS (server flags), VLLM, PY, and the trees:
# head = TREE_HEAD (a git worktree of 566d9cb, before), ef = TREE_EF (of ef28e96, the issues' starting point),
# new0 = TREE_NEW0 (of 602ca59), new = TREE (this tree), spinN = this tree with
# KVSERVE_KERNEL_SPIN_US=N; yieldN / parkN / propN = TREE_YIELD / TREE_PARK / TREE_PROP, the pool variants tried
# (README of this folder).
set -u
OUT=$1; R=$2; shift 2
VB=${VLLM:-/root/peers/vllm/bin/vllm}; PY=${PY:-$PWD/.venv/bin/python}; CK=${CK:-$PWD/checkpoints/shakespeare-small}
TREE=${TREE:-$PWD}
mkdir -p $OUT
for v in "$@"; do
  D=$OUT/r$R-$v; mkdir -p $D
  envs="X=1"
  T=$TREE
  case $v in spin*) envs="KVSERVE_KERNEL_SPIN_US=${v#spin}";; yield*) T=$TREE_YIELD; envs="KVSERVE_KERNEL_SPIN_US=${v#yield}";; park*) T=$TREE_PARK; envs="KVSERVE_KERNEL_SPIN_US=${v#park}";; head) T=$TREE_HEAD;; new0) T=$TREE_NEW0;; ef) T=$TREE_EF;; new) T=$TREE;; prop*) T=$TREE_PROP; envs="KVSERVE_KERNEL_SPIN_US=${v#prop}";; esac
  (cd $T && exec env $envs $PY -m server --checkpoint $CK --host 127.0.0.1 --port 8100 --log-level warning ${FLAGS:-}) > $D/server.log 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8100/health >/dev/null && break; sleep 0.5; done
  M=$(curl -s http://127.0.0.1:8100/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  b() { timeout 600 $VB bench serve --backend openai --base-url http://127.0.0.1:8100 --endpoint /v1/completions --model $M \
      --tokenizer $CK --dataset-name random --random-input-len 64 --random-output-len 128 --ignore-eos --temperature 0 \
      --max-concurrency $1 --num-prompts $2 --seed $R --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el \
      --metric-percentiles 50,90,99 --save-result --result-dir $D --result-filename $3.json > $D/$3.log 2>&1; }
  b 4 8 warmup
  for lv in ${LEVELS:-1:48}; do c=${lv%:*}; n=${lv#*:}
  b $c $n c$c
  python3 - $D/c$c.json $v $R $c $(cut -d' ' -f1 /proc/loadavg) >> $OUT/summary.txt <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); print(sys.argv[3], sys.argv[2], "c="+sys.argv[4], round(d["output_throughput"],1), "p50", round(d["median_itl_ms"],3), "p99", round(d["p99_itl_ms"],3), "ratio", round(d["p99_itl_ms"]/d["median_itl_ms"],2), "ttft50", round(d["median_ttft_ms"],1), "load", sys.argv[5])
PY
  done
  kill $SPID; wait $SPID 2>/dev/null; sleep 2
done
