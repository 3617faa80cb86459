"""`python -m server` (console script `kvserve`): serve a checkpoint over HTTP with uvicorn.

Bad input ends the process at once, so that a supervisor sees it: a flag value that cannot work is a
usage error (exit 2, before anything loads); a checkpoint that cannot be loaded is a start-up failure
(exit 1, one line saying why; the traceback only with --log-level debug)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from model.checkpoint import DEFAULT_CHECKPOINT
from server.engine.config import EngineConfig

BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


def _at_least(kind: type, low: float, strict: bool = True) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value

    return parse


def parse_bytes(text: str) -> int:
    """'134217728', '128MiB', '1.5GB', '512k' -> bytes."""
    text = text.strip()
    number = text.rstrip("bBiIkKmMgG")
    unit = text[len(number) :].lower()
    try:
        value = int(float(number) * BYTE_UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 134217728, 128MiB, 1GB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


EXIT_USAGE, EXIT_STARTUP = 2, 1  # a bad flag value (argparse's status too); a checkpoint that does not load


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m server", description="Serve a checkpoint: TGI and OpenAI APIs.")
    ap.add_argument(
        "--checkpoint",
        type=Path,
        default=DEFAULT_CHECKPOINT,
        help="the checkpoint directory: config.json, model.safetensors, tokenizer.json",
    )
    ap.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) requests may ask for, as in vLLM; answers report the first "
        "(default: the checkpoint directory's name)",
    )
    ap.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (0.0.0.0, every interface, only behind --api-key or a proxy you trust)",
    )
    ap.add_argument("--port", type=int, default=8000, help="the port to listen on")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1...")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    eng = ap.add_argument_group("engine", "see docs/how-it-works/kv-cache.md and docs/how-it-works/scheduling.md")
    defaults = EngineConfig()
    eng.add_argument(
        "--max-num-seqs",
        type=_at_least(int, 0),
        default=defaults.max_num_seqs,
        help="requests running at once, at most (they also need KV-cache blocks)",
    )
    eng.add_argument(
        "--max-waiting",
        type=_at_least(int, 0, strict=False),
        default=defaults.max_waiting,
        help="requests queued beyond those running; past that, 429",
    )
    eng.add_argument(
        "--max-num-batched-tokens",
        type=_at_least(int, 0),
        default=defaults.max_num_batched_tokens,
        help="tokens one step computes: every decode row, then prompt chunks up to this budget "
        "(a hard cap, with or without --target-step-ms)",
    )
    eng.add_argument(
        "--target-step-ms",
        type=_at_least(float, 0),
        default=defaults.target_step_ms,
        help="size prompt chunks so that a step with decode rows takes about this long, from a cost "
        "per token measured at warm-up and corrected as the server runs (default: off, the "
        "token cap alone)",
    )
    eng.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=defaults.kv_cache_memory,
        help="bytes of KV cache for all layers (e.g. 128MiB, 1GB); sets the number of blocks (default: "
        "32 full-context sequences of the model, at most a quarter of the free memory)",
    )
    eng.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the KV cache's dtype: auto (the model's), or bfloat16 under a float32 model (half the "
        "bytes a token holds and a step reads; keys and values rounded when written)",
    )
    eng.add_argument(
        "--block-size",
        type=_at_least(int, 0),
        default=defaults.block_size,
        help="tokens per KV-cache block (a multiple of 8 for the exact kernels)",
    )
    eng.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="never reuse the keys and values of a prompt prefix another request computed",
    )
    eng.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "exact", "stock"],
        help="exact: our bit-exact CPU kernels; stock: torch's (default: exact where they run)",
    )
    eng.add_argument(
        "--quantization",
        default=None,
        choices=["int8"],
        help="int8: quantize the weights of every product at load (exact kernels, AVX512-VNNI)",
    )
    eng.add_argument(
        "--threads",
        type=_at_least(int, 0),
        default=None,
        help="CPU threads for the model (default: torch's, one per core)",
    )
    eng.add_argument(
        "--engine-niceness",
        type=int,
        choices=range(20),
        default=defaults.engine_niceness,
        metavar="0..19",
        help="added to the nice value of the engine's compute threads, so that the "
        "threads streaming tokens run first when the cores are oversubscribed (Linux; default: 0 here, "
        "4 on the replicas of `python -m server.cluster`)",
    )
    eng.add_argument(
        "--stream-interval-ms",
        type=_at_least(float, 0, strict=False),
        default=defaults.stream_interval_ms,
        help="wake the event loop streaming tokens at most once "
        "per this many ms (a request's first and last tokens at once): fewer wake-ups where steps are "
        "faster (default: 0 here, every step; 5 on the replicas of `python -m server.cluster`)",
    )
    spec = ap.add_argument_group("speculative decoding", "see docs/speculative.md")
    spec.add_argument(
        "--speculative",
        choices=["ngram"],
        default=defaults.speculative,
        help="ngram: draft tokens by prompt lookup and verify them exactly (the output is unchanged); default: off",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=_at_least(int, 0),
        default=defaults.num_speculative_tokens,
        help="the most draft tokens a request verifies in one step (K)",
    )
    spec.add_argument(
        "--prompt-lookup-min",
        type=_at_least(int, 0),
        default=defaults.prompt_lookup_min,
        help="the shortest n-gram a draft is looked up by",
    )
    spec.add_argument(
        "--prompt-lookup-max",
        type=_at_least(int, 0),
        default=defaults.prompt_lookup_max,
        help="the longest n-gram a draft is looked up by (tried first)",
    )
    spec.add_argument(
        "--ngram-history",
        type=_at_least(int, 0, strict=False),
        default=defaults.ngram_history,
        help="n of the n-gram history the requests share: a request drafts what followed its last n "
        "tokens in any earlier request of the same cache_salt (0: its own tokens only)",
    )
    ap.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    sec = ap.add_argument_group("security")
    sec.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health and the playground page "
        "(default: $KVSERVE_API_KEY; unset: no key)",
    )
    sec.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed to call the API, e.g. http://localhost:3000 (repeatable; "
        "default: none, CORS off)",
    )
    lim = ap.add_argument_group("limits", "each refusal names its flag; see docs/api/limits.md")
    lim.add_argument(
        "--max-body-bytes", type=_at_least(int, 0), default=2_000_000, help="larger request bodies get 413"
    )
    lim.add_argument(
        "--max-input-tokens",
        type=_at_least(int, 0),
        default=None,
        help="longest prompt in tokens (default: the context less one)",
    )
    lim.add_argument(
        "--max-new-tokens",
        type=_at_least(int, 0),
        default=None,
        help="most tokens one request may generate (default: what the context leaves)",
    )
    lim.add_argument("--max-stop-sequences", type=_at_least(int, 0), default=4, help="stop strings per request")
    lim.add_argument("--max-stop-length", type=_at_least(int, 0), default=256, help="characters per stop string")
    lim.add_argument("--max-n", type=_at_least(int, 0), default=16, help="choices per prompt (OpenAI's n)")
    lim.add_argument(
        "--max-best-of",
        type=_at_least(int, 0),
        default=16,
        help="sequences generated per prompt to pick from (best_of)",
    )
    lim.add_argument(
        "--max-logprobs",
        type=_at_least(int, 0),
        default=20,
        help="alternatives per token (logprobs, top_logprobs, top_n_tokens; 20 at most)",
    )
    lim.add_argument("--max-prompts", type=_at_least(int, 0), default=64, help="prompts in one completions request")
    lim.add_argument(
        "--request-timeout",
        type=_at_least(float, 0),
        default=None,
        help="seconds a request may run, and the most parameters.timeout may ask (default: none)",
    )
    lim.add_argument(
        "--shutdown-grace",
        type=_at_least(float, 0, strict=False),
        default=30.0,
        help="on SIGTERM, seconds requests in flight get to finish before they are ended",
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def usage_error(ap: argparse.ArgumentParser, message: str) -> int:
    """As argparse reports a bad flag: the usage line, then the message; the status to exit with."""
    ap.print_usage(sys.stderr)
    print(f"{ap.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def configure_logging(level: str) -> None:
    """The root logger at --log-level; 'trace' is uvicorn's level below debug, which logging knows only once
    uvicorn configured its own loggers (later than this): named here, so that it is not an unknown level."""
    from uvicorn.logging import TRACE_LOG_LEVEL

    logging.addLevelName(TRACE_LOG_LEVEL, "TRACE")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def check_args(args: argparse.Namespace) -> tuple[str, str] | None:
    """The flags, and the checkpoint's files without loading the weights (config.json, the weights file's
    header): (kind, message) for the first problem, kind 'usage' (a flag) or 'startup' (the checkpoint)."""
    from model.checkpoint import CheckpointError, inspect_checkpoint
    from model.device import resolve_device, resolve_dtype
    from model.kv_cache import PagedKVCache, resolve_kv_cache_dtype

    try:
        resolve_device(args.device)
        dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype))
    except ValueError as e:
        return "usage", str(e)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (args.checkpoint / f).is_file()]
    if missing:
        return "usage", f"{args.checkpoint} is not a complete checkpoint (missing {', '.join(missing)})"
    try:
        model_config = inspect_checkpoint(args.checkpoint)
    except CheckpointError as e:
        return "startup", str(e)
    try:
        blocks = PagedKVCache.blocks_for_memory(model_config, args.kv_cache_memory, args.block_size, dtype)
        PagedKVCache.check_holds_a_context(model_config, blocks, args.block_size, dtype)
    except ValueError as e:
        return "usage", str(e)
    return None


def engine_config_from(args: argparse.Namespace, threads: int | None = None) -> EngineConfig:
    """The engine flags as the engine's config (`threads` overrides --threads); ValueError for a
    combination that cannot work. `python -m server.cluster` builds each replica's from the same flags."""
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        max_num_batched_tokens=args.max_num_batched_tokens,
        target_step_ms=args.target_step_ms,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.prefix_caching,
        threads=args.threads if threads is None else threads,
        kernels=args.kernels,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        ngram_history=args.ngram_history,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        engine_niceness=args.engine_niceness,
        stream_interval_ms=args.stream_interval_ms,
    )


def limits_from(args: argparse.Namespace):
    """The limit flags as the HTTP layer's `Limits`."""
    from server.api.limits import Limits

    return Limits(
        max_body_bytes=args.max_body_bytes,
        max_input_tokens=args.max_input_tokens,
        max_new_tokens=args.max_new_tokens,
        max_stop_sequences=args.max_stop_sequences,
        max_stop_length=args.max_stop_length,
        request_timeout=args.request_timeout,
        max_n=args.max_n,
        max_best_of=args.max_best_of,
        max_logprobs=min(args.max_logprobs, 20),
        max_prompts=args.max_prompts,
    )


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        kind, message = problem
        if kind == "usage":
            return usage_error(ap, message)
        print(f"error: {message}", file=sys.stderr)
        return EXIT_STARTUP
    import uvicorn

    from model.device import resolve_device
    from server.api.app import GracefulServer, create_app
    from server.engine import Engine, EngineArgs

    configure_logging(args.log_level)
    device = resolve_device(args.device)
    try:
        config = engine_config_from(args)
    except ValueError as e:
        return usage_error(ap, str(e))
    engine_args = EngineArgs(checkpoint=args.checkpoint, device=str(device), dtype=args.dtype, config=config)
    limits = limits_from(args)
    failed: list[str] = []  # set by the loading thread when the engine does not load

    def stop_on_load_failure(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    app = create_app(
        lambda: Engine.from_args(engine_args),
        model_name=args.served_model_name or args.checkpoint.name,
        limits=limits,
        api_key=args.api_key,
        cors_origins=args.cors_origin,
        shutdown_grace=args.shutdown_grace,
        on_load_failure=stop_on_load_failure,
    )
    # uvicorn waits for open connections on shutdown; the engine ends its requests after the grace,
    # so this bound is only a backstop
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_grace + 10,
    )
    server = GracefulServer(config)
    server.run()
    return EXIT_STARTUP if failed else 0


if __name__ == "__main__":
    sys.exit(main())
