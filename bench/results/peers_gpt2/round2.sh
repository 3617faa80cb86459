#!/usr/bin/env bash
R=2; OUT=/tmp/final/out
P=/tmp/final/compare.sh; PEERS=/root/peers
NOAMX=/root/peers/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin/llama-server
FAST="--quantization int8 --kv-cache-dtype bfloat16 --target-step-ms 40 --max-num-batched-tokens 512"
log() { echo "$(date +%T) load $(cut -d' ' -f1 /proc/loadavg) $*" >> $OUT/log.txt; }
cd /work/main
log "round $R gpt2 start"
OURS_ARGS="$FAST" KVMEM=1GiB bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2-fast $R "ours-f32"
KVMEM=2GiB bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2 $R "ours-f32"
LLAMA_BIN=$NOAMX bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2 $R "llama-f16"
LLAMA_ARGS=--no-repack bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2-amxbuild-norepack $R "llama-q8_0"
bash $P $PEERS /root/ckpt/gpt2 $OUT/gpt2 $R "vllm-bf16"
log "gpt2 done"
KVMEM=128MiB bash $P $PEERS /work/main/checkpoints/shakespeare-small $OUT/default-main $R "ours-f32"
(cd /tmp/base && PROJECT=/tmp/base PY=/work/main/.venv/bin/python KVMEM=128MiB bash $P $PEERS /tmp/base/checkpoints/shakespeare-small $OUT/default-base $R "ours-f32")
log "default done"
bash /tmp/final/ngram.sh $R
log "round 2 done"
