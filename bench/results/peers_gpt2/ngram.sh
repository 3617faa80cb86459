#!/usr/bin/env bash
# ngram.sh R: ours plain / speculative K=4 / K=8, llama-server none / ngram-* on the default checkpoint, c=1.
R=$1; OUT=/tmp/final/out/ngram.jsonl; cd /work/main
LB=/root/peers/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin/llama-server
run() {  # label, then the server command
  label=$1; shift
  "$@" > /tmp/final/out/ngram-$label.log 2>&1 &
  pid=$!
  for i in $(seq 1 240); do curl -sf localhost:8500/health >/dev/null && break; sleep 0.5; done
  python3 /tmp/final/ngram.py http://127.0.0.1:8500 $MODEL 5 $OUT "r$R-$label"
  kill $pid; wait $pid 2>/dev/null; sleep 1
}
MODEL=shakespeare-small
run ours-plain .venv/bin/python -m server --port 8500 --log-level warning
run ours-ngram-k4 .venv/bin/python -m server --port 8500 --log-level warning --speculative ngram
run ours-ngram-k8 .venv/bin/python -m server --port 8500 --log-level warning --speculative ngram --num-speculative-tokens 8
MODEL=x
for t in none ngram-simple ngram-map-k ngram-mod ngram-cache; do
  run llama-$t $LB -m /root/peers/gguf/model-f32.gguf --host 127.0.0.1 --port 8500 -t 2 -c 2048 --spec-type $t
done
