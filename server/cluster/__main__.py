"""`python -m server.cluster`: the checkpoint served by N engine replicas on Ray Serve, behind the same
HTTP API as `python -m server`. Starts a local Ray (`ray.init`) or joins the cluster at $RAY_ADDRESS.

    python -m server.cluster --checkpoint DIR --replicas N --port P [--router kv|pow2|round-robin]
                             [--min-replicas A --max-replicas B --target-ongoing-requests T]
                             [every engine and limit flag of `python -m server`, applied to each replica]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from server.__main__ import (
    EXIT_STARTUP,
    _at_least,
    check_args,
    configure_logging,
    engine_config_from,
    limits_from,
    usage_error,
)
from server.__main__ import parse_args as parse_server_args
from server.cluster.router import DEFAULT_IMBALANCE_THRESHOLD, POLICIES

DEFAULT_REPLICAS = 2
CLUSTER_STREAM_INTERVAL_MS = 5.0  # least time between a replica engine's wake-ups of its loop (why: BENCHMARKS.md)
CLUSTER_ENGINE_NICENESS = 4  # Ray starts its workers at nice 15: the replicas' compute at 19 (BENCHMARKS.md 16)


def cluster_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m server.cluster",
        add_help=False,
        description="Serve a checkpoint from replicas on Ray Serve (engine and limit flags "
        "as `python -m server --help` lists them, per replica).",
    )
    ap.add_argument("--help", "-h", action="store_true")
    ap.add_argument(
        "--replicas",
        type=_at_least(int, 0),
        default=None,
        help="engine replicas (default 2; with "
        "autoscaling the initial number, by default 2 held within --min-replicas and --max-replicas)",
    )
    ap.add_argument(
        "--router",
        choices=POLICIES,
        default="kv",
        help="kv: the replica holding the longest cached prefix, unless too loaded; pow2: Ray Serve's "
        "power of two choices; round-robin",
    )
    ap.add_argument(
        "--imbalance-threshold",
        type=_at_least(int, 0, strict=False),
        default=DEFAULT_IMBALANCE_THRESHOLD,
        help="kv: requests of load gap past which the least loaded replica wins",
    )
    ap.add_argument("--replica-cpus", type=_at_least(float, 0), default=1.0, help="Ray CPUs reserved per replica")
    ap.add_argument(
        "--min-replicas",
        type=_at_least(int, 0, strict=False),
        default=None,
        help="autoscaling: fewest replicas (needs --max-replicas)",
    )
    ap.add_argument(
        "--max-replicas",
        type=_at_least(int, 0),
        default=None,
        help="autoscaling: most replicas; set, Serve scales on ongoing requests per replica",
    )
    ap.add_argument(
        "--target-ongoing-requests",
        type=_at_least(float, 0),
        default=8.0,
        help="autoscaling: the ongoing requests per replica Serve aims for",
    )
    ap.add_argument(
        "--ray-num-cpus",
        type=_at_least(int, 0),
        default=None,
        help="CPUs of the local Ray started when $RAY_ADDRESS is unset (default: all)",
    )
    ap.add_argument(
        "--engine-niceness",
        type=int,
        choices=range(20),
        default=CLUSTER_ENGINE_NICENESS,
        metavar="0..19",
        help="added to each replica's engine-thread nice value: the ingress and the "
        "replicas' streaming threads run before the compute when they share cores (default: 4)",
    )
    ap.add_argument(
        "--stream-interval-ms",
        type=_at_least(float, 0, strict=False),
        default=CLUSTER_STREAM_INTERVAL_MS,
        help="each replica's engine hands its tokens to the replica's streams at most once per this "
        "many ms, bar a request's first and last (default: 5; 0: every step)",
    )
    ap.add_argument(
        "--no-feeds",
        dest="feeds",
        action="store_false",
        help="each request's events ride its own call to its replica (an item per request and step), "
        "not the replica's feed (an item per step for all of them)",
    )
    ap.add_argument(
        "--serve-proxy",
        action="store_true",
        help="local Ray: serve HTTP through Ray Serve's proxy, a second hop for every token, instead "
        "of from the ingress replica itself (Serve's direct ingress, the default)",
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cluster_parser()
    ours, rest = ap.parse_known_args(argv)
    if ours.help:
        ap.print_help()
        print("\nengine, limit and HTTP flags (per replica):")
        parse_server_args(["--help"])
    args = parse_server_args(rest)
    for key, value in vars(ours).items():
        setattr(args, key, value)
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


def settings_from(args: argparse.Namespace):
    """The deployment from the flags: each replica's engine config and the ingress's limits are built by
    `python -m server`'s own functions. ValueError for an engine config that cannot work."""
    from server.cluster.app import ClusterSettings

    # one kernel thread per Ray CPU a replica holds, unless --threads says otherwise
    config = engine_config_from(args, threads=args.threads or max(1, int(args.replica_cpus)))
    device = "cpu" if args.device == "auto" else args.device
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


def _spare_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _stop(grace: float, joined: bool) -> None:
    """The ingress drains first, as `python -m server` does (503 for new requests, those in flight finish:
    its `begin_shutdown`, through the app's handle), then our application goes: Serve and all, or on a
    cluster we joined our application alone. On one event loop: Serve's throughput-optimized handles are
    used from one, and shut down on it."""
    from ray import serve

    try:
        await asyncio.wait_for(serve.get_app_handle("kvserve").begin_shutdown.remote(), grace + 10)
    except Exception as e:  # noqa: BLE001 - Serve stops it anyway, with its own graceful wait
        logging.getLogger("kvserve.cluster").warning("the ingress did not drain: %r", e)
    if joined:  # its other applications, and Serve, stay
        serve.delete("kvserve")
    else:
        await serve.shutdown_async()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    problem = check_args(args)  # the flags and the checkpoint, as `python -m server` checks them, before Ray starts
    if problem is not None:
        kind, message = problem
        if kind == "usage":
            return usage_error(cluster_parser(), message)
        print(f"error: {message}", file=sys.stderr)
        return EXIT_STARTUP
    proxy_port = args.port
    if not os.environ.get("RAY_ADDRESS"):  # a Ray we start: set before Ray is imported and started
        from server.cluster.env import direct_ingress_env, own_ray_env

        for name, value in own_ray_env().items():
            os.environ.setdefault(name, value)
        if not args.serve_proxy:  # the ingress replica listens on --port, Serve's proxy (still started) on a spare one
            os.environ.update(direct_ingress_env(args.port))
            proxy_port = _spare_port(args.host)
    try:
        settings = settings_from(args)
    except ValueError as e:
        return usage_error(cluster_parser(), str(e))
    import ray
    from ray import serve

    from server.cluster.app import build_app

    if os.environ.get("RAY_ADDRESS"):  # the cluster's own Serve settings decide how HTTP comes in
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": proxy_port})
    serve.run(build_app(settings), name="kvserve", route_prefix="/")
    logging.getLogger("kvserve.cluster").info(
        "serving on http://%s:%d with %d replica(s), router %s",
        args.host,
        args.port,
        settings.replicas,
        settings.router,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    asyncio.run(_stop(settings.shutdown_grace, joined=bool(os.environ.get("RAY_ADDRESS"))))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
