"""The real server under load: `python -m bench.serving [--quick]`.

Starts `python -m server` on 127.0.0.1 (a free port), waits for /health, runs the load-test tool
at each concurrency in each cache mode side by side (off: use_cache false; kv: the KV cache with no
prefix reuse across requests; prefix: the KV cache and prefix caching), writes JSON and plots, stops
the server. `--shared-prefix-tokens N` puts one N-token passage in front of every prompt.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.common import RESULTS_DIR, base_parser, machine_info, resolve, write_result
from loadtest.client import LoadTestConfig, run_load_test
from loadtest.prompts import load_prompts
from loadtest.report import render_tables, write_plots


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {process.returncode}; its log:\n" + log_path.read_text()[-3000:]
                )
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s; log in {log_path}")


@contextmanager
def running_server(
    checkpoint: str,
    device: str,
    dtype: str,
    log_path: Path,
    flags: list[str],
    startup_timeout_s: float = 600.0,
    module: str = "server",
):
    """Yields the base URL of a server subprocess (`python -m module`, `server.cluster` for the Ray
    path) started with `flags`; stops it on exit."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        module,
        "--checkpoint",
        checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        *flags,
    ]
    env = None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_health(url, process, log_path, startup_timeout_s)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.serving", __doc__)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--num-requests", type=int, default=64, help="per run")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds per run before no new request")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-modes", default="prefix,kv,off")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0)
    ap.add_argument("--name", default="serving", help="results file name (bench/results/NAME.json)")
    ap.add_argument("--server-flag", action="append", default=[], help="passed to the server (repeatable)")
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    out = Path(args.out) if args.out else RESULTS_DIR
    if args.quick:
        args.concurrency, args.num_requests, args.prompt_tokens, args.max_new_tokens = "1,2", 4, 16, 8
    prompts, prompt_note = load_prompts(
        64, args.prompt_tokens, None, args.checkpoint, shared_prefix_tokens=args.shared_prefix_tokens
    )
    name = args.name
    flags = [*args.server_flag, "--kernels", "auto" if args.kernels == "both" else args.kernels]
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--quantization", args.quantization] if args.quantization else []
    with running_server(args.checkpoint, str(device), args.dtype, out / f"{name}_server.log", flags) as url:
        config = LoadTestConfig(
            url=url,
            concurrency=tuple(int(c) for c in args.concurrency.split(",")),
            cache_modes=tuple(args.cache_modes.split(",")),
            num_requests=args.num_requests,
            duration_s=args.duration,
            request_timeout_s=600.0,
            timeout_s=3600.0,
            max_new_tokens=args.max_new_tokens,
        )
        report = asyncio.run(
            run_load_test(config, prompts, on_run_start=lambda label, n: print(f"{label}: {n} requests", flush=True))
        )
    report["prompts"] = prompt_note
    from rich.console import Console

    for table in render_tables(report):
        Console().print(table)
    plots = write_plots(report, out / f"{name}_plots")
    result = {
        "benchmark": "serving",
        "machine": machine_info(device, dtype),
        "checkpoint": args.checkpoint,
        "quick": args.quick,
        "server_flags": flags,
        "plots": [str(p) for p in plots],
        **report,
    }
    write_result(name, result, str(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
