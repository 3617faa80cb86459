"""Reliability under churn: `python -m bench.soak [--requests 500] [--kv-cache-memory 8MiB]`.

Starts `python -m server` with a small KV cache and sends mixed requests at a fixed concurrency: TGI's
and OpenAI's routes, streamed and not, greedy and seeded, short and long prompts, part of them behind
one shared prefix. A share of them is dropped by the client at a random point: before the first event
(mid-prefill, the long prompts among them) or after a few tokens. Then it checks what must hold:

- every greedy request that finished gave the text the same request gives alone (run afterwards,
  one at a time): preemption, batching, prefix sharing and neighbours' cancellations change nothing;
- once idle, no KV-cache block is held by a request (kvserve:kv_cache_usage_perc is 0);
- the server's resident memory before and after.

It reports requests, preemptions (the server's counter), drops, wrong greedy outputs, blocks held
afterwards and RSS, and writes them to bench/results/soak.json. The run stops at --duration-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.common import RESULTS_DIR, machine_info, write_result
from bench.serving import free_port, wait_for_health
from loadtest.prompts import build_prompts, default_corpus
from model.checkpoint import DEFAULT_CHECKPOINT, load_tokenizer

ROUTES = ("tgi_stream", "tgi", "openai_stream", "openai")


@dataclass(frozen=True)
class SoakRequest:
    index: int  # order of submission
    route: str  # one of ROUTES
    prompt: str
    max_new_tokens: int
    seed: int | None  # None: greedy (checked against a solo run)
    drop_after_events: int | None  # None: read to the end; 0: drop before the first event (mid-prefill)
    drop_delay_s: float  # with drop_after_events 0: how long after sending


@dataclass
class SoakReport:
    requests: int = 0  # sent
    completed: int = 0  # read to their end with a finish reason
    dropped: int = 0  # closed by the client before their end
    dropped_before_first_event: int = 0  # of those, before any event arrived (prefill or queue)
    failed: int = 0  # an HTTP error or an error event (none expected)
    greedy_checked: int = 0  # finished greedy requests compared with a solo run
    wrong_greedy_outputs: int = 0
    preemptions: int = 0  # kvserve:num_preemptions_total over the run
    blocks_held_after: float = 0.0  # KV-cache blocks still held by requests once idle
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)  # the first few, for the log


def plan(
    count: int,
    prompts: list[str],
    shared_prefix: str,
    drop_share: float,
    greedy_share: float,
    max_new_tokens: int,
    seed: int,
) -> list[SoakRequest]:
    """The mixed workload; `prompts` are cycled so that greedy requests repeat (each is checked once)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = prompts[rng.randrange(len(prompts))]
        if rng.random() < 0.5:
            prompt = shared_prefix + prompt
        drop = rng.random() < drop_share
        out.append(
            SoakRequest(
                index=i,
                route=rng.choice(ROUTES) if not drop else rng.choice(("tgi_stream", "openai_stream", "tgi")),
                prompt=prompt,
                max_new_tokens=rng.choice((8, 32, max_new_tokens)),
                seed=None if rng.random() < greedy_share else rng.randrange(2**31),
                drop_after_events=(0 if rng.random() < 0.5 else rng.randrange(1, 8)) if drop else None,
                drop_delay_s=rng.uniform(0.0, 0.05),
            )
        )
    return out


def body_of(req: SoakRequest) -> tuple[str, dict]:
    sampling = {"temperature": 0.0} if req.seed is None else {"temperature": 0.9, "seed": req.seed}
    if req.route.startswith("tgi"):
        parameters = {"max_new_tokens": req.max_new_tokens, "details": False}
        if req.seed is not None:
            parameters.update(do_sample=True, temperature=0.9, seed=req.seed)
        return ("/generate_stream" if req.route == "tgi_stream" else "/generate"), {
            "inputs": req.prompt,
            "parameters": parameters,
        }
    return "/v1/completions", {
        "prompt": req.prompt,
        "max_tokens": req.max_new_tokens,
        "stream": req.route == "openai_stream",
        **sampling,
    }


def text_of_events(route: str, events: list[dict]) -> str:
    if route == "tgi_stream":
        return events[-1]["generated_text"]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


async def send(client: httpx.AsyncClient, req: SoakRequest) -> tuple[str, str | None]:
    """('completed', text) | ('dropped', None) | ('failed', why)."""
    path, body = body_of(req)
    if req.route in ("tgi", "openai"):
        if req.drop_after_events is not None:  # a plain request dropped while it runs
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(req.drop_delay_s)
            if not task.done():
                task.cancel()
                return "dropped", None
            r = task.result()
        else:
            r = await client.post(path, json=body)
        if r.status_code != 200:
            return "failed", f"{path} {r.status_code} {r.text[:200]}"
        data = r.json()
        return "completed", data["generated_text"] if path == "/generate" else data["choices"][0]["text"]
    events: list[dict] = []

    async def read() -> tuple[str, str | None]:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return "failed", f"{path} {r.status_code} {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return "failed", f"{path} error event {event}"
                events.append(event)
                if req.drop_after_events is not None and len(events) >= req.drop_after_events:
                    return "dropped", None  # leaving the block closes the connection mid-stream
        return "completed", text_of_events(req.route, events)

    if req.drop_after_events == 0:
        task = asyncio.ensure_future(read())
        await asyncio.sleep(req.drop_delay_s)
        if not task.done():
            task.cancel()
            return "dropped", None
        return task.result()
    return await read()


async def run_workload(
    url: str, requests: list[SoakRequest], concurrency: int, duration_s: float, report: SoakReport
) -> dict[tuple[str, int], str]:
    """Sends `requests` with `concurrency` in flight; returns each finished greedy request's text."""
    queue: asyncio.Queue = asyncio.Queue()
    for req in requests:
        queue.put_nowait(req)
    greedy: dict[tuple[str, int], str] = {}
    stop_at = time.monotonic() + duration_s

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.monotonic() < stop_at:
            req = queue.get_nowait()
            report.requests += 1
            outcome, value = await send(client, req)
            if outcome == "completed":
                report.completed += 1
                if req.seed is None:
                    key = (req.prompt, req.max_new_tokens)
                    if greedy.setdefault(key, value) != value:  # two batched runs already disagree
                        report.wrong_greedy_outputs += 1
                        report.failures.append(f"request {req.index}: differs from an earlier identical one")
            elif outcome == "dropped":
                report.dropped += 1
                report.dropped_before_first_event += req.drop_after_events == 0
            else:
                report.failed += 1
                report.failures.append(f"request {req.index}: {value}")

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return greedy


def check_solo(url: str, greedy: dict[tuple[str, int], str], report: SoakReport) -> None:
    """Each distinct greedy request again, alone, through /generate: its text must be the same."""
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as client:
        for (prompt, max_new), text in greedy.items():
            r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": max_new}})
            report.greedy_checked += 1
            if r.status_code != 200 or r.json()["generated_text"] != text:
                report.wrong_greedy_outputs += 1
                report.failures.append(f"solo run differs for a {max_new}-token greedy request: {r.text[:200]}")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(url, "kvserve:num_requests_running") + metric(url, "kvserve:num_requests_waiting") > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the server still runs requests after the soak")
        time.sleep(0.2)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def soak(url: str, pid: int, requests: list[SoakRequest], concurrency: int, duration_s: float) -> SoakReport:
    """The soak against a running server (process `pid`)."""
    report = SoakReport()
    info = httpx.get(url + "/info", timeout=30, trust_env=False).json()
    num_blocks = info["max_batch_total_tokens"] // info["block_size"]
    report.rss_before_mib = rss_mib(pid)
    preemptions = metric(url, "kvserve:num_preemptions_total")
    start = time.monotonic()
    greedy = asyncio.run(run_workload(url, requests, concurrency, duration_s, report))
    report.wall_s = time.monotonic() - start
    wait_idle(url)
    report.preemptions = int(metric(url, "kvserve:num_preemptions_total") - preemptions)
    report.blocks_held_after = metric(url, "kvserve:kv_cache_usage_perc") * num_blocks
    check_solo(url, greedy, report)
    wait_idle(url)
    report.rss_after_mib = rss_mib(pid)
    return report


def start_server(checkpoint: str, flags: list[str], log_path: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--checkpoint",
            checkpoint,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process, log_path, 600)
    except BaseException:
        process.kill()
        raise
    return url, process


def workload(
    checkpoint: str, count: int, max_new_tokens: int, seed: int, drop_share: float, greedy_share: float
) -> list[SoakRequest]:
    """Prompts of 8 to 200 tokens from the corpus; a 96-token shared prefix in front of half of them."""
    tokenizer = load_tokenizer(checkpoint)
    corpus = default_corpus()
    prompts = [p for n in (8, 32, 96, 200) for p in build_prompts(corpus, 6, n, tokenizer, seed + n)]
    prefix = build_prompts(corpus, 1, 95, tokenizer, seed=10**6)[0] + "\n"
    return plan(count, prompts, prefix, drop_share, greedy_share, max_new_tokens, seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="8MiB", help="small, so that requests preempt each other")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="the longest generation (others: 8, 32)")
    ap.add_argument("--drop-share", type=float, default=0.2, help="requests the client drops")
    ap.add_argument("--greedy-share", type=float, default=0.6, help="greedy requests (checked against solo runs)")
    ap.add_argument("--duration-s", type=float, default=1800, help="stop sending after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help=f"output folder (default {RESULTS_DIR})")
    args = ap.parse_args(argv)
    requests = workload(
        args.checkpoint, args.requests, args.max_new_tokens, args.seed, args.drop_share, args.greedy_share
    )
    flags = [
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-num-seqs",
        str(args.concurrency),
        "--max-waiting",
        str(args.concurrency * 2),
    ] + (["--threads", str(args.threads)] if args.threads else [])
    url, process = start_server(args.checkpoint, flags, Path(args.out or RESULTS_DIR) / "soak_server.log")
    try:
        report = soak(url, process.pid, requests, args.concurrency, args.duration_s)
    finally:
        process.terminate()
        process.wait(30)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine_info(),
        "report": asdict(report),
    }
    path = write_result("soak", result, args.out)
    print(json.dumps(asdict(report), indent=2))
    print(f"written to {path}")
    return 0 if report.wrong_greedy_outputs == 0 and report.failed == 0 and report.blocks_held_after == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
