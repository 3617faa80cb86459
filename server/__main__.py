"""`python -m server` (console script `kvserve`): serve a checkpoint over HTTP with uvicorn.

The flags and the checks before anything loads are server/cli.py's. Then the port is bound, and only then
does the engine start loading: a port in use or a host that is not this machine's ends the process at once
with one line (exit 1), before any engine thread runs."""

from __future__ import annotations

import socket
import sys

from server.cli import (
    EXIT_STARTUP,
    build_parser,
    check_args,
    configure_logging,
    engine_config_from,
    limits_from,
    usage_error,
)


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address `host` resolves to, as uvicorn (asyncio's create_server) binds them:
    address reuse on, IPv6 sockets IPv6 only. OSError (socket.gaierror for a host that does not resolve)
    if any cannot be bound; none is left open then."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        kind, message = problem
        if kind == "usage":
            return usage_error(ap, message)
        print(f"error: {message}", file=sys.stderr)
        return EXIT_STARTUP
    try:
        config = engine_config_from(args)
    except ValueError as e:
        return usage_error(ap, str(e))
    try:
        sockets = listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on --host {args.host} --port {args.port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_STARTUP
    import uvicorn

    from model.device import resolve_device
    from server.api.app import GracefulServer, create_app
    from server.engine import Engine, EngineArgs

    configure_logging(args.log_level)
    device = resolve_device(args.device)
    engine_args = EngineArgs(checkpoint=args.checkpoint, device=str(device), dtype=args.dtype, config=config)
    failed: list[str] = []  # set by the loading thread when the engine does not load

    def stop_on_load_failure(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    app = create_app(
        lambda: Engine.from_args(engine_args),
        model_name=args.served_model_name or args.checkpoint.name,
        limits=limits_from(args),
        api_key=args.api_key,
        cors_origins=args.cors_origin,
        shutdown_grace=args.shutdown_grace,
        on_load_failure=stop_on_load_failure,
    )
    # uvicorn waits for open connections on shutdown; the engine ends its requests after the grace,
    # so this bound is only a backstop
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_grace + 10,
        )
    )
    server.run(sockets=sockets)
    return EXIT_STARTUP if failed else 0


if __name__ == "__main__":
    sys.exit(main())
