"""What the cluster tests ask of the apps over HTTP: consecutive free ports (Serve's direct ingress listens
on one per application), the application on a port, requests, and /metrics' figures."""

from __future__ import annotations

import json
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


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json=body, timeout=120, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def requests_by_stream(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return {
        stream: float(line.rsplit(" ", 1)[1])
        for stream in ("feed", "call")
        for line in text.splitlines()
        if line.startswith(f'kvserve:cluster_requests_total{{stream="{stream}"}}')
    }


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replica_pids(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    pids = {}
    for line in text.splitlines():
        if line.startswith("kvserve:replica_pid{"):
            pids[line.split('"')[1]] = int(float(line.rsplit(" ", 1)[1]))
    return pids
