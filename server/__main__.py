"""`python -m server` (console script `kvserve`): serve a checkpoint over HTTP with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from model.checkpoint import DEFAULT_CHECKPOINT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m server", description="Serve a checkpoint: TGI and OpenAI APIs.")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1...")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--max-batch", type=int, default=32, help="concurrent sequences (KV-cache slots)")
    ap.add_argument("--max-waiting", type=int, default=128, help="queued requests beyond --max-batch; then 429")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens one request reads per step")
    ap.add_argument("--max-prefill-tokens", type=int, default=512, help="prompt tokens all requests read per step")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for the model (default on a CPU: all cores but one, kept for the HTTP loop)")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn  # imported here so `--help` stays fast

    from model.device import resolve_device
    from server.app import create_app
    from server.engine import Engine, EngineArgs

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
    threads = args.threads
    if threads is None and device.type == "cpu":
        threads = max(1, (os.cpu_count() or 1) - 1)
    engine_args = EngineArgs(checkpoint=args.checkpoint, device=str(device), dtype=args.dtype,
                             max_batch=args.max_batch, max_waiting=args.max_waiting,
                             prefill_chunk=args.prefill_chunk, max_prefill_tokens=args.max_prefill_tokens,
                             threads=threads)
    app = create_app(lambda: Engine.from_args(engine_args), model_name=args.checkpoint.name)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
