"""How Ray Serve is set up in a Ray that we start ourselves (imports no Ray: it must run before Ray is imported)."""

from __future__ import annotations


def direct_ingress_env(first_port: int, ports: int = 1) -> dict[str, str]:
    """Ray Serve's environment for a Ray that we start ourselves (set before `ray.init`, which hands it
    to every Ray process): Serve's throughput-optimized mode, whose direct ingress has each ingress
    replica serve HTTP itself, so a token crosses one process boundary (replica to ingress) instead of
    two (then ingress to Serve's HTTP proxy); the ingress replicas listen on `first_port` onwards, one
    port per application; no draining hold on shutdown (it waits for load balancers, and there is none)."""
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + ports),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def own_ray_env() -> dict[str, str]:
    """Settings for any Ray that we start ourselves, direct ingress or not (a value already in the
    environment wins): Serve's controller loop every second instead of every 0.1 s. Idle, that loop was
    the largest of Ray's own CPU users on a 2-core machine (BENCHMARKS.md, "The cluster's defaults"); at 1 s it
    notices a dead replica or an autoscaling decision within a second instead of a tenth."""
    return {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0"}
