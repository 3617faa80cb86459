"""The ingress's /metrics beyond the summed `kvserve:*` (which the app's own Metrics carries, bound to the
client's sums): each replica's gauges labelled by replica, and the router's decisions."""

from __future__ import annotations

from collections.abc import Callable

from server.api.metrics import PREFIX
from server.cluster.client import RayEngineClient
from server.cluster.router import ReplicaReport, Router

PER_REPLICA: list[tuple[str, str, str, Callable[[ReplicaReport], float]]] = [  # (name, help, type, value)
    ("replica_num_requests_running", "Requests holding KV-cache blocks, by replica.", "gauge", lambda r: r.running),
    ("replica_num_requests_waiting", "Requests queued, by replica.", "gauge", lambda r: r.waiting),
    (
        "replica_kv_cache_usage_perc",
        "Fraction of KV-cache blocks held, by replica.",
        "gauge",
        lambda r: r.kv_cache_usage,
    ),
    (
        "replica_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache, by replica.",
        "counter",
        lambda r: r.counters.prefix_cache_queries,
    ),
    (
        "replica_prefix_cache_hits_total",
        "Prompt tokens served from the prefix cache, by replica.",
        "counter",
        lambda r: r.counters.prefix_cache_hits,
    ),
    (
        "replica_cached_blocks",
        "Full blocks the replica's prefix cache holds (its last report).",
        "gauge",
        lambda r: len(r.held_keys),
    ),
    ("replica_pid", "The replica's process id.", "gauge", lambda r: r.pid),
]


def cluster_metrics(client: RayEngineClient, router: Router | None) -> str:
    lines = []
    reports = client.reports()
    for name, doc, kind, value in PER_REPLICA:
        lines += [f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} {kind}"]
        for r in reports:
            lines.append(f'{PREFIX}{name}{{replica="{r.replica_id}"}} {float(value(r))}')
    name = PREFIX + "router_decisions_total"
    lines += [
        f"# HELP {name} Requests a replica took, by policy and outcome (hit: a cached prefix chose the replica; "
        "miss: none was cached; fallback: the load imbalance chose the least loaded; rebalance: the prefix moved "
        "off a replica whose reused prefixes overflow its cache; redirect: Ray sent it elsewhere; baseline: "
        "pow2 or round-robin).",
        f"# TYPE {name} counter",
    ]
    for (policy, outcome), count in sorted((router.decisions if router else {}).items()):
        lines.append(f'{name}{{policy="{policy}",outcome="{outcome}"}} {float(count)}')
    name = PREFIX + "router_requests_in_flight"
    lines += [
        f"# HELP {name} Requests this router placed on the replica that have not ended, waiting in Serve's "
        "queue or taken, by replica.",
        f"# TYPE {name} gauge",
    ]
    for replica_id, state in sorted((router.replicas if router else {}).items()):
        lines.append(f'{name}{{replica="{replica_id}"}} {float(state.inflight)}')
    name = PREFIX + "cluster_requests_total"
    lines += [
        f"# HELP {name} Calls a replica took, by the stream their events rode: the replica's feed (one item "
        "a step for all of them) or the call's own.",
        f"# TYPE {name} counter",
    ]
    for stream in ("feed", "call"):
        lines.append(f'{name}{{stream="{stream}"}} {float(client.feeds.requests_by_stream[stream])}')
    name = PREFIX + "cluster_feeds_failed_total"
    lines += [
        f"# HELP {name} Replica feeds that broke or were never attached (a request on one is sent again, or "
        "ends with an error if some of its events had come).",
        f"# TYPE {name} counter",
        f"{name} {float(client.feeds.feeds_failed)}",
    ]
    return "\n".join(lines) + "\n"
