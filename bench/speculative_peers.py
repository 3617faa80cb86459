"""Speculative decoding against other servers' modes: `python -m bench.speculative_peers URL MODEL LABEL`.

One server already running at URL, one request at a time: POST /v1/completions, greedy, 160 new tokens
(`ignore_eos`), a passage repeated three times, the kind of prompt an n-gram drafter predicts; tokens/s
of client wall time per request, the median of `--requests` after one warm-up. It starts no server, so
the same command measures ours (`python -m server --speculative ngram ...`) and llama-server (its
`--spec-type` modes) alike. With `--play FILE`, every request (the warm-up too) repeats a different
passage of that text (six lines from an offset of its own), so that no request finds its text in an
earlier one's. Each run appends one JSON line to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import RESULTS_DIR

PASSAGE = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, "
    "that thou her maid art far more fair than she.\n\n"
)
MAX_TOKENS = 160
REPEATS = 3  # times the passage appears in a prompt
PLAY_FIRST_LINE, PLAY_STRIDE, PLAY_LINES = 2000, 300, 6  # where request i's passage starts in --play's text


@dataclass
class Run:
    """One server's run: what `--out` gets as a JSON line."""

    label: str
    tok_s_median: float
    tok_s: list[float]  # one a measured request, in order
    tokens: int  # new tokens of the last request
    same_text_every_run: bool
    text_head: str  # the first request's first 80 characters
    distinct_passages: bool
    text_heads: list[str] | None  # each request's first 40 characters, with --play


def prompt_for(request: int, play: list[str] | None) -> str:
    """The prompt of request `request` (0 is the warm-up): the passage, or its own lines of the play."""
    if play is None:
        return PASSAGE * REPEATS
    start = PLAY_FIRST_LINE + PLAY_STRIDE * request
    return ("\n".join(play[start : start + PLAY_LINES]) + "\n\n") * REPEATS


def complete(url: str, model: str, prompt: str, timeout_s: float = 300.0) -> tuple[str, int, float]:
    """One greedy completion: its text, its new tokens (the server's own count) and its wall seconds."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        url.rstrip("/") + "/v1/completions", body, {"Content-Type": "application/json", "Connection": "close"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer = json.load(response)
    wall = time.perf_counter() - start
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"], wall


def measure(url: str, model: str, label: str, requests: int, play: list[str] | None = None) -> Run:
    """A warm-up, then `requests` requests one after the other; tokens/s of each measured one."""
    rates, texts, tokens = [], [], 0
    for i in range(requests + 1):
        text, tokens, wall = complete(url, model, prompt_for(i, play))
        if i:  # the first is the warm-up
            rates.append(tokens / wall)
            texts.append(text)
    return Run(
        label=label,
        tok_s_median=statistics.median(rates),
        tok_s=rates,
        tokens=tokens,
        same_text_every_run=len(set(texts)) == 1,
        text_head=texts[0][:80],
        distinct_passages=play is not None,
        text_heads=[t[:40] for t in texts] if play is not None else None,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speculative_peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the running server, e.g. http://127.0.0.1:8100")
    ap.add_argument("model", help="the model name its /v1/completions expects")
    ap.add_argument("label", help="names this run in the output (e.g. ours-ngram-k4, llama-ngram-mod)")
    ap.add_argument("--requests", type=int, default=5, help="measured requests, after one warm-up")
    ap.add_argument("--play", type=Path, default=None, help="a text file: a different passage every request")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "speculative_peers.jsonl", help="JSON lines, appended")
    args = ap.parse_args(argv)
    play = args.play.read_text().splitlines() if args.play else None
    run = measure(args.url, args.model, args.label, args.requests, play)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(asdict(run)) + "\n")
    print(f"{run.label}: median {run.tok_s_median:.0f} tok/s of {len(run.tok_s)}, same text: {run.same_text_every_run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
