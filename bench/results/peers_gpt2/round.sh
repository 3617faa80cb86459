#!/usr/bin/env bash
# round.sh R : one round of every server in turns (one at a time), GPT-2 small, medium, default checkpoint.
R=$1; OUT=/tmp/final/out; mkdir -p $OUT
P=/tmp/final/compare.sh; PEERS=/root/peers
NOAMX=/root/peers/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin/llama-server
FAST="--quantization int8 --kv-cache-dtype bfloat16 --target-step-ms 40 --max-num-batched-tokens 512"
log() { echo "$(date +%T) load $(cut -d' ' -f1 /proc/loadavg) $*" >> $OUT/log.txt; }
cd /work/main
log "round $R gpt2 start"
OURS_ARGS="$FAST" KVMEM=1GiB bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2-fast $R "ours-f32"
log "gpt2 ours-fast done"
KVMEM=2GiB bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2 $R "ours-f32"
LLAMA_BIN=$NOAMX bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2 $R "llama-q8_0 llama-f16"
LLAMA_ARGS=--no-repack bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2-amxbuild-norepack $R "llama-q8_0"
bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2 $R "vllm-bf16"
log "gpt2 others done"
OURS_ARGS="$FAST" KVMEM=2GiB bash $P $PEERS /root/ckpt/gpt2-medium $OUT/medium-fast $R "ours-f32" "1:16 32:64"
LLAMA_BIN=$NOAMX bash $P $PEERS /root/ckpt/gpt2-medium $OUT/medium $R "llama-q8_0" "1:16 32:64"
log "medium done"
KVMEM=128MiB bash $P $PEERS /work/main/checkpoints/shakespeare-small $OUT/default-main $R "ours-f32"
(cd /tmp/base && PROJECT=/tmp/base PY=/work/main/.venv/bin/python KVMEM=128MiB bash $P $PEERS /tmp/base/checkpoints/shakespeare-small $OUT/default-base $R "ours-f32")
log "round $R done"
if [ "$R" = 1 ]; then
  for cfg in "--dtype float32" "--dtype bfloat16" "--dtype float32 --quantization int8" "--dtype float32 --quantization int8 --kv-cache-dtype bfloat16"; do
    n=$(echo "$cfg" | sed "s/--dtype //;s/ --quantization /-/;s/ --kv-cache-dtype /-kv-/")
    .venv/bin/python -m bench.bandwidth --checkpoint /root/ckpt/gpt2 $cfg --steps 10 --repeats 5 --batches 1 32 --name step_$n --out /tmp/final/out/bandwidth > /tmp/final/out/bandwidth_$n.log 2>&1
  done
  log "bandwidth done"
fi
bash /tmp/final/ngram.sh $R
log "ngram done"
