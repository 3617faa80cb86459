"""One server at c=1: POST /v1/completions, greedy, 160 tokens, a passage repeated three times; tok/s of
wall time per request (client side), median of N. usage: ngram.py URL MODEL N OUT_JSON LABEL [PLAY_FILE]
With PLAY_FILE, every request (the warm-up too) repeats a different passage of that play (six lines from
an offset of its own), so no request finds its text in an earlier one's."""

import json
import statistics
import sys
import time
import urllib.request

url, model, n, out, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
play = open(sys.argv[6]).read().splitlines() if len(sys.argv) > 6 else None
passage = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, "
    "that thou her maid art far more fair than she.\n\n"
)
prompt = passage * 3
rates, texts = [], []
for i in range(n + 1):
    if play:
        start = 2000 + 300 * i
        prompt = ("\n".join(play[start : start + 6]) + "\n\n") * 3
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json", "Connection": "close"}
    )
    t = time.perf_counter()
    d = json.load(urllib.request.urlopen(req, timeout=300))
    wall = time.perf_counter() - t
    tokens = d["usage"]["completion_tokens"]
    if i:  # the first is a warm-up
        rates.append(tokens / wall)
        texts.append(d["choices"][0]["text"])
row = {
    "label": label,
    "tok_s_median": statistics.median(rates),
    "tok_s": rates,
    "tokens": tokens,
    "same_text_every_run": len(set(texts)) == 1,
    "text_head": texts[0][:80],
    "distinct_passages": bool(play),
    "text_heads": [t[:40] for t in texts] if play else None,
}
open(out, "a").write(json.dumps(row) + "\n")
print(json.dumps(row)[:200])
