"""Load-test client for the streaming endpoint: `python -m loadtest.client --url URL [options]`.

Sends `POST {url}/generate_stream` requests, timestamps every streamed token on arrival, and
reports per run (a concurrency level or a request rate, with the KV cache on or off):

- requests ok / failed: a request is ok when its stream ends with a final event and no error.
- TTFT (time to first token): from sending the request to receiving its first token.
- TPOT (time per output token) = (e2e − TTFT) / (tokens − 1), one value per request with at
  least two tokens; the mean over a request's decode steps, so every request weighs the same.
- ITL (inter-token latency): every gap between two consecutive streamed tokens of a request,
  pooled over all requests; long requests contribute more gaps, and stalls show in p99.
- E2E (end-to-end latency): from sending the request to receiving its final event.
- output tokens/s: tokens streamed by ok requests / the run's wall time (first send to last end).
- requests/s: ok requests / the run's wall time.
- Each latency is reported as mean / p50 / p90 / p99 (percentiles by linear interpolation
  between closest ranks, as numpy's default), over ok requests only.
- cache modes (`--cache-modes`, or `--compare-cache` for all three): the same workload against the
  same server with `use_cache: false` (`off`: every step recomputes the whole sequence), with the KV
  cache but no reuse across requests (`kv`: a fresh `cache_salt` per request), and with the KV cache
  and prefix caching (`prefix`: what the server does by default). Each comparison's ratio is the
  faster mode over the slower one (kv/off, prefix/off, prefix/kv), so a ratio above 1 is a gain for
  throughput and a ratio below 1 a gain for latency.
- prefix-cache hit rate: prompt tokens the server served from its prefix cache (its
  `details.cached_tokens`) over all prompt tokens of the run's ok requests.
- `--shared-prefix-tokens N` puts the same N-token passage in front of every prompt: the workload
  where prefix caching pays (a system prompt, a few-shot header, a shared document). `--tenants K`
  makes K such passages and gives each prompt one at random (K tenants' system prompts).
- ITL by token index: the mean gap before output token i+1, over the requests that reached it;
  uncached, every step recomputes the whole sequence so this grows with i; cached, it stays flat.
- `--response-format json_object|SCHEMA.json`: a structured-output workload, every request held to any
  JSON object or to a JSON schema (TGI's parameters.grammar); compare with the same run without it.

Closed loop (`--concurrency 1,4,16`): N clients, each sending its next request when its last one
ends. Open loop (`--request-rate R`): Poisson arrivals at R requests/s whatever the server does.
Every run stops issuing at `--num-requests` or `--duration`, whichever comes first, and
cancels what is still in flight at duration + `--request-timeout`; `--timeout` bounds the whole
tool. Only the address given by `--url` is contacted; proxy environment variables are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from loadtest.prompts import load_prompts
from loadtest.report import RequestRecord, cache_ratio, summarize
from loadtest.server_steps import scrape_steps, steps_between

DEFAULT_URL = "http://127.0.0.1:8000"
# ---------------------------------------------------------------- the HTTP client

CACHE_MODES = ("off", "kv", "prefix")


@dataclass(frozen=True)
class RequestParams:
    max_new_tokens: int = 128
    cache_mode: str = "prefix"  # off: use_cache false; kv: a fresh cache_salt per request; prefix: plain
    ignore_eos: bool = True  # ask for exactly max_new_tokens; dropped if the server rejects it
    temperature: float = 0.0  # 0 = greedy
    grammar: dict | None = None  # TGI's parameters.grammar: structured output (a JSON schema); None: free text

    def body(self, prompt: str) -> dict:
        parameters = {"max_new_tokens": self.max_new_tokens, "use_cache": self.cache_mode != "off", "details": True}
        if self.cache_mode == "kv":
            parameters["cache_salt"] = uuid.uuid4().hex  # no prefix reuse across requests
        if self.ignore_eos:
            parameters["ignore_eos"] = True
        if self.grammar is not None:
            parameters["grammar"] = self.grammar
        if self.temperature > 0:
            parameters.update(do_sample=True, temperature=self.temperature)
        else:
            parameters["do_sample"] = False
        return {"inputs": prompt, "parameters": parameters}


def _error_from_body(record: RequestRecord, status: int, raw: bytes) -> None:
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {"error": raw.decode("utf-8", errors="replace")[:500]}
    if not isinstance(payload, dict):
        payload = {"error": str(payload)}
    record.error = str(payload.get("error") or payload.get("detail") or payload)[:500]
    record.error_type = payload.get("error_type") or f"http_{status}"


async def stream_one(
    client: aiohttp.ClientSession, url: str, prompt: str, params: RequestParams, record: RequestRecord
) -> RequestRecord:
    """Sends one request and fills `record` as events arrive (so a cancelled request keeps its partial record)."""
    seen_indices: set[int] = set()
    try:
        async with client.post(f"{url}/generate_stream", json=params.body(prompt)) as response:
            record.status = response.status
            if response.status != 200:
                _error_from_body(record, response.status, await response.read())
                return record
            async for line in response.content:  # one line at a time, its newline included
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(payload)
                if event.get("error") is not None:
                    record.error, record.error_type = str(event["error"]), event.get("error_type") or "stream_error"
                    return record
                index = event.get("index")
                if event.get("token") is not None and index not in seen_indices:
                    record.token_times.append(now)
                    if index is not None:
                        seen_indices.add(index)
                if event.get("generated_text") is not None or event.get("details") is not None:
                    details = event.get("details") or {}
                    record.end, record.ok = now, True
                    record.finish_reason = details.get("finish_reason")
                    record.server_generated_tokens = details.get("generated_tokens")
                    record.prompt_tokens = details.get("input_length")
                    record.cached_tokens = details.get("cached_tokens")
                    record.draft_tokens = details.get("draft_tokens")
                    record.accepted_draft_tokens = details.get("accepted_draft_tokens")
                    return record
        record.error, record.error_type = "the stream ended without a final event", "truncated_stream"
    except (aiohttp.ClientError, TimeoutError) as e:
        record.error, record.error_type = f"{type(e).__name__}: {e}"[:500], type(e).__name__
    except (ValueError, HttpProcessingError) as e:  # bad JSON, or a line past read_bufsize (LineTooLong)
        record.error, record.error_type = f"unparseable event: {e}"[:500], "bad_event"
    return record


def make_client(request_timeout: float) -> aiohttp.ClientSession:
    """aiohttp rather than httpx: its C parser and line reader take a third of the CPU per streamed token
    or less (BENCHMARKS.md, "Serving under load"), which matters when the tool shares the server's cores. Proxy
    variables are ignored (aiohttp reads them only with trust_env=True)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=request_timeout),
        connector=aiohttp.TCPConnector(limit=0),
        read_bufsize=1 << 20,
    )


# ---------------------------------------------------------------- one run: closed or open loop


@dataclass(frozen=True)
class Workload:
    concurrency: int | None = None  # closed loop: this many clients
    request_rate: float | None = None  # open loop: Poisson arrivals per second
    num_requests: int = 32
    duration_s: float = 60.0
    request_timeout_s: float = 120.0
    seed: int = 0


async def run_workload(
    url: str,
    prompts: list[str],
    params: RequestParams,
    workload: Workload,
    on_done: Callable[[RequestRecord], None] | None = None,
    deadline: float | None = None,
) -> tuple[list[RequestRecord], float]:
    """Runs one closed- or open-loop run. Returns every issued request's record and the wall time."""
    records: list[RequestRecord] = []
    begin = time.perf_counter()
    stop_issuing = begin + workload.duration_s
    hard_stop = min(stop_issuing + workload.request_timeout_s, deadline or math.inf)

    async def send(i: int) -> None:
        record = RequestRecord(start=time.perf_counter())
        records.append(record)
        await stream_one(client, url, prompts[i % len(prompts)], params, record)
        if on_done:
            on_done(record)

    async def closed_loop_client() -> None:
        nonlocal issued
        while issued < workload.num_requests and time.perf_counter() < stop_issuing:
            issued += 1
            await send(issued - 1)

    async def open_loop_arrivals() -> None:
        rng, arrival, tasks = random.Random(workload.seed), begin, []
        for i in range(workload.num_requests):
            arrival += rng.expovariate(workload.request_rate)
            if arrival >= stop_issuing:
                break
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)

    issued = 0
    async with make_client(workload.request_timeout_s) as client:
        if workload.request_rate is not None:
            tasks = [asyncio.create_task(open_loop_arrivals())]
        else:
            tasks = [asyncio.create_task(closed_loop_client()) for _ in range(workload.concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, hard_stop - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.end is None and record.error is None:
            record.error, record.error_type = "cancelled at the run's time limit", "timeout"
    ends = [r.end if r.end is not None else time.perf_counter() for r in records]
    return records, (max(ends) - begin) if ends else 0.0


async def probe(url: str, prompt: str, params: RequestParams, timeout_s: float) -> tuple[RequestParams, dict]:
    """One short request first (it also warms the server). Drops ignore_eos if the server answers 422."""
    notes: dict = {"ignore_eos_supported": params.ignore_eos}

    async def short_request(p: RequestParams) -> RequestRecord:
        short = replace(p, max_new_tokens=min(2, p.max_new_tokens))
        return await stream_one(client, url, prompt, short, RequestRecord(start=time.perf_counter()))

    async with make_client(timeout_s) as client:
        record = await short_request(params)
        if not record.ok and record.status == 422 and params.ignore_eos:
            notes.update(ignore_eos_supported=False, ignore_eos_rejected_with=record.error)
            params = replace(params, ignore_eos=False)
            record = await short_request(params)
    if not record.ok:
        raise ConnectionError(f"probe request to {url}/generate_stream failed: {record.error_type}: {record.error}")
    return params, notes


# ---------------------------------------------------------------- a whole load test


@dataclass(frozen=True)
class LoadTestConfig:
    url: str = DEFAULT_URL
    concurrency: tuple[int, ...] = (1,)  # closed-loop levels
    request_rates: tuple[float, ...] = ()  # open-loop rates; when given, used instead of concurrency
    cache_modes: tuple[str, ...] = ("prefix",)  # of CACHE_MODES, run side by side at each level
    num_requests: int = 32  # per run
    duration_s: float = 60.0  # per run: no new request after this
    request_timeout_s: float = 120.0
    timeout_s: float = 1800.0  # the whole load test
    max_new_tokens: int = 128
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    response_format: str | None = None  # structured output: json_object, or a JSON schema file's path


def response_grammar(response_format: str | None) -> dict | None:
    """TGI's parameters.grammar for --response-format: any JSON object (json_object), or the JSON schema in a
    file. A request whose grammar completes ends there, before max_new_tokens even with ignore_eos."""
    if response_format is None:
        return None
    if response_format == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    try:
        schema = json.loads(Path(response_format).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--response-format {response_format!r}: not json_object nor a JSON schema file ({e})") from e
    return {"type": "json", "value": schema}


def run_labels(config: LoadTestConfig) -> list[dict]:
    """The runs in order: each level with every cache mode side by side."""
    levels = [{"concurrency": None, "request_rate": r} for r in config.request_rates] or [
        {"concurrency": c, "request_rate": None} for c in config.concurrency
    ]
    return [
        {
            **level,
            "cache_mode": mode,
            "label": (f"c={level['concurrency']}" if level["concurrency"] else f"rate={level['request_rate']:g}/s")
            + f" {mode}",
        }
        for level in levels
        for mode in config.cache_modes
    ]


async def run_load_test(
    config: LoadTestConfig,
    prompts: list[str],
    on_run_start: Callable[[str, int], None] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> dict:
    """Probes the server, then runs every level and cache mode. Returns the JSON-ready report."""
    deadline = time.perf_counter() + config.timeout_s
    params = RequestParams(
        max_new_tokens=config.max_new_tokens,
        cache_mode=config.cache_modes[0],
        ignore_eos=config.ignore_eos,
        temperature=config.temperature,
        grammar=response_grammar(config.response_format),
    )
    params, server_notes = await probe(config.url, prompts[0], params, config.request_timeout_s)
    for mode in config.cache_modes[1:]:
        await probe(config.url, prompts[0], replace(params, cache_mode=mode), config.request_timeout_s)
    runs, skipped = [], []
    for labels in run_labels(config):
        if time.perf_counter() >= deadline:
            skipped.append(labels["label"])
            continue
        workload = Workload(
            concurrency=labels["concurrency"],
            request_rate=labels["request_rate"],
            num_requests=config.num_requests,
            duration_s=config.duration_s,
            request_timeout_s=config.request_timeout_s,
            seed=config.seed,
        )
        if on_run_start:
            on_run_start(labels["label"], config.num_requests)
        async with make_client(config.request_timeout_s) as client:
            before = await scrape_steps(client, config.url)
        records, wall_s = await run_workload(
            config.url, prompts, replace(params, cache_mode=labels["cache_mode"]), workload, on_done, deadline
        )
        async with make_client(config.request_timeout_s) as client:
            after = await scrape_steps(client, config.url)
        runs.append({**summarize(records, wall_s, **labels), "server_steps": steps_between(before, after)})
    ratios = []
    for faster, slower in (("kv", "off"), ("prefix", "off"), ("prefix", "kv")):
        for a in (r for r in runs if r["cache_mode"] == faster):
            b = next(
                (
                    r
                    for r in runs
                    if r["cache_mode"] == slower
                    and r["concurrency"] == a["concurrency"]
                    and r["request_rate"] == a["request_rate"]
                ),
                None,
            )
            if b is not None:
                ratios.append(
                    {
                        "concurrency": a["concurrency"],
                        "request_rate": a["request_rate"],
                        "numerator": faster,
                        "denominator": slower,
                        "ratio": cache_ratio(a, b),
                    }
                )
    return {
        "config": asdict(config),
        "server": server_notes,
        "runs": runs,
        "cache_ratios": ratios,
        "skipped_runs_at_timeout": skipped,
    }


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default=DEFAULT_URL, help="the server to test (nothing else is contacted)")
    ap.add_argument("--concurrency", default="1", help="closed-loop levels, comma-separated, e.g. 1,4,16,32")
    ap.add_argument("--request-rate", default=None, help="open loop: Poisson arrivals per second (comma list ok)")
    ap.add_argument("--num-requests", type=int, default=32, help="per run")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per run before no new request is sent")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds for one request")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole load test")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts-file", default=None, help="JSON list of strings, or one prompt per line (used as is)")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint dir whose tokenizer.json cuts prompts to exact token counts "
        "(default: the default checkpoint's if present, else approximate by words)",
    )
    ap.add_argument("--num-prompts", type=int, default=64, help="distinct prompts cut from the corpus")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests end at EOS")
    ap.add_argument(
        "--response-format",
        default=None,
        metavar="json_object|SCHEMA.json",
        help="structured output: every request's text is any JSON object, or matches the JSON schema in this "
        "file (TGI's parameters.grammar); a request ends when its JSON is complete",
    )
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument(
        "--cache-modes",
        default="prefix",
        help="comma-separated, run side by side: off (use_cache false), kv (the KV cache, a fresh "
        "cache_salt per request), prefix (KV cache and prefix caching, the server's default)",
    )
    cache.add_argument("--compare-cache", action="store_true", help="all three modes: --cache-modes prefix,kv,off")
    cache.add_argument("--no-cache", action="store_true", help="send use_cache=false (--cache-modes off)")
    ap.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="the same passage of this many tokens in front of every prompt",
    )
    ap.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="K shared prefixes (--shared-prefix-tokens each, 256 by default), one drawn per prompt: "
        "the workload for KV-aware routing over replicas (python -m server.cluster)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--plot-dir", default=None)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def cache_modes(args: argparse.Namespace) -> tuple[str, ...]:
    if args.compare_cache:
        return ("prefix", "kv", "off")
    if args.no_cache:
        return ("off",)
    modes = tuple(m.strip() for m in args.cache_modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in CACHE_MODES]
    if unknown or not modes:
        raise SystemExit(f"error: unknown cache mode(s) {unknown}; choose from {', '.join(CACHE_MODES)}")
    return modes


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    return LoadTestConfig(
        url=args.url.rstrip("/"),
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        request_rates=tuple(float(r) for r in args.request_rate.split(",")) if args.request_rate else (),
        cache_modes=cache_modes(args),
        num_requests=args.num_requests,
        duration_s=args.duration,
        request_timeout_s=args.request_timeout,
        timeout_s=args.timeout,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        response_format=args.response_format,
    )


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from loadtest.report import progress_bar, render_tables, write_plots

    args = parse_args(argv)
    config = config_from_args(args)
    if min(config.concurrency) < 1 or any(r <= 0 for r in config.request_rates) or config.num_requests < 1:
        print("error: concurrency, request rate and --num-requests must be positive", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    try:
        response_grammar(config.response_format)  # a bad schema file stops here, before any request
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts, prompt_note = load_prompts(
        args.num_prompts,
        args.prompt_tokens,
        args.prompts_file,
        args.tokenizer,
        args.seed,
        args.shared_prefix_tokens,
        args.tenants,
    )
    try:
        with progress_bar(console, disabled=args.quiet) as (on_run_start, on_done):
            report = asyncio.run(
                asyncio.wait_for(run_load_test(config, prompts, on_run_start, on_done), config.timeout_s + 30)
            )
    except (ConnectionError, asyncio.TimeoutError) as e:
        print(f"error: {e or 'the load test ran past --timeout'}", file=sys.stderr)
        return 2
    report["prompts"] = prompt_note
    for table in render_tables(report):
        Console().print(table)
    if not report["server"]["ignore_eos_supported"]:
        console.print(
            "[yellow]the server rejected ignore_eos: requests may end early at EOS; "
            "token counts above are the actual ones[/yellow]"
        )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.json_out}")
    if args.plot_dir:
        for path in write_plots(report, args.plot_dir):
            console.print(f"wrote {path}")
    return 0 if any(r["requests_ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
