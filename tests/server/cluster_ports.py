"""Ports and routes for the cluster tests: Serve's direct ingress listens on consecutive ports, one per
application."""
from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """A port p with p + 1 ... p + count - 1 also free (the apps' ingress replicas listen on them)."""
    for _ in range(50):
        p = free_port()
        try:
            for k in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + k))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_routes(port: int, timeout: float) -> dict:
    """The application an ingress replica serves (Serve's `/-/routes` on its own port): {prefix: app}."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/-/routes", timeout=5, trust_env=False)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no ingress answered on port {port} in {timeout} s")
