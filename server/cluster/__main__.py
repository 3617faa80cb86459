"""`python -m server.cluster`: the checkpoint served by N engine replicas on Ray Serve, behind the same
HTTP API as `python -m server`. Starts a local Ray (`ray.init`) or joins the cluster at $RAY_ADDRESS.

    python -m server.cluster --checkpoint DIR --replicas N --port P [--router kv|pow2|round-robin]
                             [--min-replicas A --max-replicas B --target-ongoing-requests T]
                             [every engine and limit flag of `python -m server`, applied to each replica]

The flags, and the checks before Ray starts, are server/cli.py's (`build_cluster_parser`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

from server.cli import (
    EXIT_STARTUP,
    build_cluster_parser,
    check_args,
    cluster_settings_from,
    configure_logging,
    parse_cluster_args,
    replica_device,
    usage_error,
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

    log = logging.getLogger("kvserve.cluster")
    try:
        await asyncio.wait_for(serve.get_app_handle("kvserve").begin_shutdown.remote(), grace + 10)
    except Exception as e:  # noqa: BLE001 - Serve stops it anyway, with its own graceful wait
        log.warning("the ingress did not drain: %r", e)
    log.info("drained; stopping Serve")
    if joined:  # its other applications, and Serve, stay
        serve.delete("kvserve")
    else:
        await serve.shutdown_async()
    log.info("Serve stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_cluster_args(argv)
    configure_logging(args.log_level)
    # the flags and the checkpoint, as `python -m server` checks them, before Ray starts; a local Ray's
    # replicas all hold their KV caches in this machine's memory
    here = 0 if os.environ.get("RAY_ADDRESS") else max(args.replicas, args.max_replicas or 0)
    problem = check_args(args, engines_here=here, device=replica_device(args))
    if problem is not None:
        kind, message = problem
        if kind == "usage":
            return usage_error(build_cluster_parser(), message)
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
        settings = cluster_settings_from(args)
    except ValueError as e:
        return usage_error(build_cluster_parser(), str(e))
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
    logging.getLogger("kvserve.cluster").info("Ray stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
