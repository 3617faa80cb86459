"""`python -m server` (console script `kvserve`): serve a checkpoint over HTTP with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from model.checkpoint import DEFAULT_CHECKPOINT
from server.scheduler import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_PREFILL_CHUNK


def _at_least(kind: type, low: float, strict: bool = True) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m server", description="Serve a checkpoint: TGI and OpenAI APIs.")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1...")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--max-batch", type=int, default=32, help="concurrent sequences (KV-cache slots)")
    ap.add_argument("--max-waiting", type=int, default=128, help="queued requests beyond --max-batch; then 429")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                    help="prompt tokens one request reads per step")
    ap.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                    help="prompt tokens all requests read per step")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for the model (default: torch's, one per core)")
    ap.add_argument("--compile", action="store_true",
                    help="run decode steps through torch.compile: faster steps, a startup that takes longer "
                         "(needs a C++ compiler on the CPU; see BENCHMARKS.md)")
    ap.add_argument("--log-level", default="info")
    sec = ap.add_argument_group("security")
    sec.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY") or None,
                     help="require 'Authorization: Bearer KEY' on every route but /health and the playground page "
                          "(default: $KVSERVE_API_KEY; unset: no key)")
    sec.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="a browser origin allowed to call the API, e.g. http://localhost:3000 (repeatable; "
                          "default: none, CORS off)")
    lim = ap.add_argument_group("limits (each refusal names its flag; see 'Limits and security' in README.md)")
    lim.add_argument("--max-body-bytes", type=_at_least(int, 0), default=2_000_000,
                     help="larger request bodies get 413")
    lim.add_argument("--max-input-tokens", type=_at_least(int, 0), default=None,
                     help="longest prompt in tokens (default: the context less one)")
    lim.add_argument("--max-new-tokens", type=_at_least(int, 0), default=None,
                     help="most tokens one request may generate (default: what the context leaves)")
    lim.add_argument("--max-stop-sequences", type=_at_least(int, 0), default=4, help="stop strings per request")
    lim.add_argument("--max-stop-length", type=_at_least(int, 0), default=256, help="characters per stop string")
    lim.add_argument("--request-timeout", type=_at_least(float, 0), default=None,
                     help="seconds a request may run, and the most parameters.timeout may ask (default: none)")
    lim.add_argument("--shutdown-grace", type=_at_least(float, 0, strict=False), default=30.0,
                     help="on SIGTERM, seconds requests in flight get to finish before they are ended")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn  # imported here so `--help` stays fast

    from model.device import resolve_device
    from server.app import GracefulServer, create_app
    from server.engine import Engine, EngineArgs
    from server.serving import Limits

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (args.checkpoint / f).is_file()]
    if missing:
        print(f"error: {args.checkpoint} is not a complete checkpoint (missing {', '.join(missing)})", file=sys.stderr)
        return 2
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_args = EngineArgs(checkpoint=args.checkpoint, device=str(device), dtype=args.dtype,
                             max_batch=args.max_batch, max_waiting=args.max_waiting,
                             prefill_chunk=args.prefill_chunk, max_prefill_tokens=args.max_prefill_tokens,
                             threads=args.threads, compile=args.compile)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_input_tokens=args.max_input_tokens,
                    max_new_tokens=args.max_new_tokens, max_stop_sequences=args.max_stop_sequences,
                    max_stop_length=args.max_stop_length, request_timeout=args.request_timeout)
    app = create_app(lambda: Engine.from_args(engine_args), model_name=args.checkpoint.name, limits=limits,
                     api_key=args.api_key, cors_origins=args.cors_origin,
                     shutdown_grace=args.shutdown_grace)
    # uvicorn waits for open connections on shutdown; the engine ends its requests after the grace,
    # so this bound is only a backstop
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace + 10)
    GracefulServer(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
