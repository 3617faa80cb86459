"""The command lines of `python -m server` and `python -m server.cluster`, in one place: every flag with its
validator and default, the checks of the flags and the checkpoint run before anything loads, and the
functions that turn parsed flags into the engine's, the HTTP layer's and the cluster's settings.

`build_parser()` and `build_cluster_parser()` return each command's full parser (the flags page of the docs is
written from them). Bad input ends the process at once, so that a supervisor sees it: a flag value that
cannot work is a usage error (exit 2, before anything loads); a checkpoint that cannot be loaded is a
start-up failure (exit 1, one line saying why; the traceback only with --log-level debug)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from model.checkpoint import DEFAULT_CHECKPOINT
from server.engine.config import EngineConfig

EXIT_USAGE, EXIT_STARTUP = 2, 1  # a bad flag value (argparse's status too); a checkpoint that does not load
MAX_PORT = 65535
DEFAULT_REPLICAS = 2
CLUSTER_STREAM_INTERVAL_MS = 5.0  # least time between a replica engine's wake-ups of its loop (why: BENCHMARKS.md)
CLUSTER_ENGINE_NICENESS = 4  # Ray starts its workers at nice 15: the replicas' compute at 19 (BENCHMARKS.md)

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


def at_least(kind: type, low: float, strict: bool = True) -> Callable[[str], int | float]:
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
    except (KeyError, ValueError, OverflowError):  # 'inf' overflows int()
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 134217728, 128MiB, 1GB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port). Larger numbers are refused here: the socket layer would take
    one modulo 65536, or a random port, while the log names the number given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port in 0..{MAX_PORT} (0: any free port), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """`python -m server`'s parser: every flag it takes."""
    ap = argparse.ArgumentParser(prog="python -m server", description="Serve a checkpoint: TGI and OpenAI APIs.")
    _add_server_flags(ap, cluster=False)
    return ap


def build_cluster_parser() -> argparse.ArgumentParser:
    """`python -m server.cluster`'s parser: every flag of `python -m server` (the engine flags apply to each
    replica, --engine-niceness and --stream-interval-ms with the replicas' own defaults), and its own."""
    from server.cluster.router import DEFAULT_IMBALANCE_THRESHOLD, POLICIES

    ap = argparse.ArgumentParser(
        prog="python -m server.cluster",
        description="Serve a checkpoint from replicas on Ray Serve: the flags of `python -m server` (the engine "
        "flags apply to each replica, the limit and security flags at the ingress) and the replicas' own.",
    )
    _add_server_flags(ap, cluster=True)
    own = ap.add_argument_group("replicas, routing and autoscaling (python -m server.cluster only)")
    own.add_argument(
        "--replicas",
        type=at_least(int, 0),
        default=None,
        help="engine replicas (default 2; with "
        "autoscaling the initial number, by default 2 held within --min-replicas and --max-replicas)",
    )
    own.add_argument(
        "--router",
        choices=POLICIES,
        default="kv",
        help="kv: the replica holding the longest cached prefix, unless too loaded; pow2: Ray Serve's "
        "power of two choices; round-robin",
    )
    own.add_argument(
        "--imbalance-threshold",
        type=at_least(int, 0, strict=False),
        default=DEFAULT_IMBALANCE_THRESHOLD,
        help="kv: requests of load gap past which the least loaded replica wins",
    )
    own.add_argument("--replica-cpus", type=at_least(float, 0), default=1.0, help="Ray CPUs reserved per replica")
    own.add_argument(
        "--min-replicas",
        type=at_least(int, 0, strict=False),
        default=None,
        help="autoscaling: fewest replicas (needs --max-replicas)",
    )
    own.add_argument(
        "--max-replicas",
        type=at_least(int, 0),
        default=None,
        help="autoscaling: most replicas; set, Serve scales on ongoing requests per replica",
    )
    own.add_argument(
        "--target-ongoing-requests",
        type=at_least(float, 0),
        default=8.0,
        help="autoscaling: the ongoing requests per replica Serve aims for",
    )
    own.add_argument(
        "--ray-num-cpus",
        type=at_least(int, 0),
        default=None,
        help="CPUs of the local Ray started when $RAY_ADDRESS is unset (default: all)",
    )
    own.add_argument(
        "--no-feeds",
        dest="feeds",
        action="store_false",
        help="each request's events ride its own call to its replica (an item per request and step), "
        "not the replica's feed (an item per step for all of them)",
    )
    own.add_argument(
        "--serve-proxy",
        action="store_true",
        help="local Ray: serve HTTP through Ray Serve's proxy, a second hop for every token, instead "
        "of from the ingress replica itself (Serve's direct ingress, the default)",
    )
    return ap


def _add_server_flags(ap: argparse.ArgumentParser, cluster: bool) -> None:
    ap.add_argument(
        "--checkpoint",
        type=Path,
        default=DEFAULT_CHECKPOINT,
        help="the checkpoint directory: config.json, model.safetensors (or its shards), tokenizer.json; "
        "GPT-2, Llama, Qwen2 or Qwen3",
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
    ap.add_argument(
        "--port", type=port_number, default=8000, help=f"the port to listen on, 0..{MAX_PORT} (0: any free port)"
    )
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1...")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    eng = ap.add_argument_group("engine", "see docs/how-it-works/kv-cache.md and docs/how-it-works/scheduling.md")
    defaults = EngineConfig()
    eng.add_argument(
        "--max-num-seqs",
        type=at_least(int, 0),
        default=defaults.max_num_seqs,
        help="requests running at once, at most (they also need KV-cache blocks)",
    )
    eng.add_argument(
        "--max-waiting",
        type=at_least(int, 0, strict=False),
        default=defaults.max_waiting,
        help="requests queued beyond those running; past that, 429",
    )
    eng.add_argument(
        "--max-num-batched-tokens",
        type=at_least(int, 0),
        default=defaults.max_num_batched_tokens,
        help="tokens one step computes: every decode row, then prompt chunks up to this budget "
        "(a hard cap, with or without --target-step-ms)",
    )
    eng.add_argument(
        "--target-step-ms",
        type=at_least(float, 0),
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
        "--max-model-len",
        type=at_least(int, 0),
        default=defaults.max_model_len,
        help="tokens one sequence may hold, prompt and output, at most the model's context (default: the "
        "model's context, or as many as the default KV cache holds when that is fewer; with --kv-cache-memory "
        "that cannot hold the model's context, start-up is refused)",
    )
    eng.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "int8"],
        help="the KV cache's dtype: auto (the model's), bfloat16 under a float32 model (half the "
        "bytes a token holds and a step reads; keys and values rounded when written), or int8 under a "
        "float32 or bfloat16 model (about a quarter of float32's: each token's head quantized when written, "
        "with its scale; the exact CPU kernels only)",
    )
    eng.add_argument(
        "--block-size",
        type=at_least(int, 0),
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
        help="int8: quantize every product's weights at load (exact kernels, any AVX2 CPU; KVSERVE_ISA picks the path)",
    )
    eng.add_argument(
        "--threads",
        type=at_least(int, 0),
        default=None,
        help="CPU threads for the model (default: torch's, one per core)",
    )
    eng.add_argument(
        "--engine-niceness",
        type=int,
        choices=range(20),
        default=CLUSTER_ENGINE_NICENESS if cluster else defaults.engine_niceness,
        metavar="0..19",
        help="added to each replica's engine-thread nice value: the ingress and the replicas' streaming "
        "threads run before the compute when they share cores (default: 4)"
        if cluster
        else "added to the nice value of the engine's compute threads, so that the "
        "threads streaming tokens run first when the cores are oversubscribed (Linux; default: 0 here, "
        "4 on the replicas of `python -m server.cluster`)",
    )
    eng.add_argument(
        "--stream-interval-ms",
        type=at_least(float, 0, strict=False),
        default=CLUSTER_STREAM_INTERVAL_MS if cluster else defaults.stream_interval_ms,
        help="each replica's engine hands its tokens to the replica's streams at most once per this "
        "many ms, bar a request's first and last (default: 5; 0: every step)"
        if cluster
        else "wake the event loop streaming tokens at most once "
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
        type=at_least(int, 0),
        default=defaults.num_speculative_tokens,
        help="the most draft tokens a request verifies in one step (K)",
    )
    spec.add_argument(
        "--prompt-lookup-min",
        type=at_least(int, 0),
        default=defaults.prompt_lookup_min,
        help="the shortest n-gram a draft is looked up by",
    )
    spec.add_argument(
        "--prompt-lookup-max",
        type=at_least(int, 0),
        default=defaults.prompt_lookup_max,
        help="the longest n-gram a draft is looked up by (tried first)",
    )
    spec.add_argument(
        "--ngram-history",
        type=at_least(int, 0, strict=False),
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
    lim.add_argument("--max-body-bytes", type=at_least(int, 0), default=2_000_000, help="larger request bodies get 413")
    lim.add_argument(
        "--max-input-tokens",
        type=at_least(int, 0),
        default=None,
        help="longest prompt in tokens (default: the context less one)",
    )
    lim.add_argument(
        "--max-new-tokens",
        type=at_least(int, 0),
        default=None,
        help="most tokens one request may generate (default: what the context leaves)",
    )
    lim.add_argument("--max-stop-sequences", type=at_least(int, 0), default=4, help="stop strings per request")
    lim.add_argument("--max-stop-length", type=at_least(int, 0), default=256, help="characters per stop string")
    lim.add_argument("--max-n", type=at_least(int, 0), default=16, help="choices per prompt (OpenAI's n)")
    lim.add_argument(
        "--max-best-of",
        type=at_least(int, 0),
        default=16,
        help="sequences generated per prompt to pick from (best_of)",
    )
    lim.add_argument(
        "--max-logprobs",
        type=at_least(int, 0),
        default=20,
        help="alternatives per token (logprobs, top_logprobs, top_n_tokens; 20 at most)",
    )
    lim.add_argument("--max-prompts", type=at_least(int, 0), default=64, help="prompts in one completions request")
    lim.add_argument(
        "--request-timeout",
        type=at_least(float, 0),
        default=None,
        help="seconds a request may run, and the most parameters.timeout may ask (default: none)",
    )
    lim.add_argument(
        "--shutdown-grace",
        type=at_least(float, 0, strict=False),
        default=30.0,
        help="on SIGTERM, seconds requests in flight get to finish before they are ended",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`python -m server`'s flags."""
    return build_parser().parse_args(argv)


def parse_cluster_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`python -m server.cluster`'s flags, with the replica counts Serve would refuse refused here (min <=
    initial <= max; the initial number defaults to 2 held within the bounds)."""
    ap = build_cluster_parser()
    args = ap.parse_args(argv)
    if args.min_replicas is not None and args.max_replicas is None:
        ap.error("--min-replicas needs --max-replicas")
    if args.max_replicas is None:
        args.replicas = DEFAULT_REPLICAS if args.replicas is None else args.replicas
        return args
    low = 1 if args.min_replicas is None else args.min_replicas  # Serve's own default
    if low > args.max_replicas:
        ap.error(f"--min-replicas ({low}) is above --max-replicas ({args.max_replicas})")
    if args.replicas is None:
        args.replicas = min(max(DEFAULT_REPLICAS, low), args.max_replicas)
    elif not low <= args.replicas <= args.max_replicas:
        ap.error(
            f"--replicas ({args.replicas}), the initial number, must lie within --min-replicas ({low}) and "
            f"--max-replicas ({args.max_replicas})"
        )
    return args


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


def check_args(args: argparse.Namespace, engines_here: int = 1, device: str | None = None) -> tuple[str, str] | None:
    """The flags, and the checkpoint's files without loading the weights (config.json, the weights file's
    header, the tokenizer): (kind, message) for the first problem, kind 'usage' (a flag) or 'startup' (the
    checkpoint). `engines_here`: the engines that will hold a KV cache in this machine's memory (or the
    device's, `device`, by default --device), each checked to fit before any is allocated; 0 checks none
    (replicas placed by a Ray cluster elsewhere)."""
    from model.checkpoint import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, CheckpointError, inspect_checkpoint
    from model.device import resolve_device, resolve_dtype
    from model.kv_cache import PagedKVCache, resolve_kv_cache_dtype
    from model.models.loader import INDEX_FILE as WEIGHTS_INDEX_FILE

    try:
        where = resolve_device(device or args.device)
        dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype))
    except ValueError as e:
        return "usage", str(e)
    checkpoint = args.checkpoint
    weights = [WEIGHTS_FILE] if not (checkpoint / WEIGHTS_INDEX_FILE).is_file() else []
    missing = [f for f in (CONFIG_FILE, *weights, TOKENIZER_FILE) if not (checkpoint / f).is_file()]
    if missing:
        return "usage", f"{checkpoint} is not a complete checkpoint (missing {', '.join(missing)})"
    try:
        model_config = inspect_checkpoint(checkpoint)
    except CheckpointError as e:
        return "startup", str(e)
    try:
        served = served_model(args, where, model_config)
        blocks = PagedKVCache.blocks_for_memory(served, args.kv_cache_memory, args.block_size, dtype)
        PagedKVCache.check_holds_a_context(served, blocks, args.block_size, dtype)
    except ValueError as e:
        flag = "" if args.max_model_len is not None else " (or lower --max-model-len)"
        return "usage", f"{e}{flag}" if "--kv-cache-memory" in str(e) else str(e)
    if args.kv_cache_memory is not None and engines_here > 0:  # the default size is bounded by the free memory
        kv_bytes = blocks * PagedKVCache.bytes_per_block(served, args.block_size, dtype)
        problem = kv_cache_memory_problem(kv_bytes, checkpoint, where, engines_here)
        if problem is not None:
            return "usage", problem
    return None


def served_model(args: argparse.Namespace, device, model_config=None):
    """The checkpoint's model description as the engine serves it under these flags: its context capped by
    --max-model-len or the default KV cache (server/engine/context_length.py). ValueError for a context that
    cannot be served."""
    from model.checkpoint import load_config
    from model.device import resolve_dtype
    from model.kv_cache import resolve_kv_cache_dtype
    from server.engine.context_length import served_config

    return served_config(
        model_config or load_config(args.checkpoint),
        max_model_len=args.max_model_len,
        kv_cache_sized=args.kv_cache_memory is not None,
        block_size=args.block_size,
        cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype)),
        device=device,
    )


def kv_cache_memory_problem(kv_bytes: int, checkpoint: Path, device, engines: int = 1) -> str | None:
    """Why --kv-cache-memory cannot be allocated, or None: the KV cache and the weights (their file's size) of
    `engines` engines must fit in the memory free now (Linux's MemAvailable, or the GPU's free memory).
    Checked before allocating, because a cache larger than the machine does not fail at once: zeroing it
    runs into the OOM killer while the server answers /health with 503."""
    from model.checkpoint import load_config, weights_files
    from model.kv_cache import available_memory

    weights = sum(f.stat().st_size for f in weights_files(checkpoint, load_config(checkpoint)))
    need, free = engines * (kv_bytes + weights), available_memory(device)
    if need <= free:
        return None
    each = f" for each of {engines} replicas" if engines > 1 else ""
    where = "on this machine" if device.type == "cpu" else f"on {device}"
    return (
        f"--kv-cache-memory asks for a KV cache of {format_bytes(kv_bytes)}{each}; with the weights "
        f"({format_bytes(weights)}) that is more than the {format_bytes(free)} of memory available {where}: "
        f"lower --kv-cache-memory"
    )


def format_bytes(n: int) -> str:
    """'59.6 GiB', '31.5 MiB', '9.31e+20 GiB'."""
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


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
        max_model_len=args.max_model_len,
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


def replica_device(args: argparse.Namespace) -> str:
    """The device of the cluster's replicas: --device, with 'auto' the CPU."""
    return "cpu" if args.device == "auto" else args.device


def cluster_settings_from(args: argparse.Namespace):
    """The deployment from `python -m server.cluster`'s flags (or a Serve config's `args`): each replica's
    engine config and the ingress's limits as `python -m server` builds its own. ValueError for an engine
    config that cannot work."""
    from model.checkpoint import CONFIG_FILE, load_config
    from server.cluster.app import ClusterSettings

    # one kernel thread per Ray CPU a replica holds, unless --threads says otherwise
    config = engine_config_from(args, threads=args.threads or max(1, int(args.replica_cpus)))
    device = replica_device(args)
    if config.max_model_len is None and config.kv_cache_memory is None and (args.checkpoint / CONFIG_FILE).is_file():
        # a context the default KV cache cannot hold is capped (server/engine/context_length.py): once, here,
        # so that the ingress and every replica serve the same one, whatever memory each finds free (a
        # checkpoint that is not there is check_args' to refuse)
        served = served_model(args, device)
        if served.context_length < load_config(args.checkpoint).context_length:
            config = dataclasses.replace(config, max_model_len=served.context_length)
    return ClusterSettings(
        checkpoint=Path(args.checkpoint).resolve(),
        replicas=args.replicas,
        router=args.router,
        imbalance_threshold=args.imbalance_threshold,
        engine=config,
        device=device,
        dtype=args.dtype,
        replica_cpus=args.replica_cpus,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        limits=limits_from(args),
        api_key=args.api_key,
        cors_origins=tuple(args.cors_origin),
        model_name=args.served_model_name,
        shutdown_grace=args.shutdown_grace,
        feeds=args.feeds,
    )
