"""The Ray Serve application: `EngineReplica` replicas behind an ingress that serves the HTTP API of
`python -m server` (the same `server/api/` app, over a `RayEngineClient`).

`build_app(settings)` returns the bound application for `serve.run`; `app_builder(args)` is the entry a
Serve config file names (`import_path: server.cluster.app:app_builder`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from server.api.errors import APIError
from server.api.limits import Limits
from server.cluster.client import DRAIN_MARGIN_S, RayEngineClient
from server.cluster.metrics import cluster_metrics
from server.cluster.ray_router import KVCacheRequestRouter
from server.cluster.replica import EngineReplica
from server.cluster.router import DEFAULT_IMBALANCE_THRESHOLD, ROUTERS
from server.engine import EngineArgs, EngineConfig

REPLICA_DEPLOYMENT = "EngineReplica"
ROUTING_STATS_PERIOD_S = 0.5  # how often Serve polls each replica's report for the router
REPEATED_FLAGS = {"cors_origin"}  # flags given once per value (argparse's append)
SHUTDOWN_WAIT_LOOP_S = 0.2  # how often a stopping replica looks for requests still running (Serve's default: 2 s)


@dataclass
class ClusterSettings:
    """What `python -m server.cluster` (or a Serve config's `args`) deploys."""

    checkpoint: Path  # the checkpoint every replica loads
    replicas: int = 2  # fixed number of replicas (without autoscaling)
    router: str = "kv"  # kv, pow2 (Ray Serve's choice) or round-robin
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD  # kv: requests of load gap past which the least loaded wins
    engine: EngineConfig = field(default_factory=EngineConfig)  # per replica (--kv-cache-memory is per replica)
    device: str = "cpu"
    dtype: str = "float32"
    replica_cpus: float = 1.0  # Ray CPUs reserved per replica
    min_replicas: int | None = None  # with max_replicas: autoscaling between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0  # autoscaling's target per replica
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    warmup: bool = True
    model_name: str | list[str] | None = None  # --served-model-name; default: the checkpoint's folder name
    shutdown_grace: float = 30.0  # --shutdown-grace: seconds requests in flight get when the app stops
    feeds: bool = True  # False (--no-feeds): each request's events ride its own call (client.py)

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


def replica_options(s: ClusterSettings) -> dict:
    """The replica deployment's Serve options: replicas or autoscaling, the router, resources."""
    opts: dict = {
        "ray_actor_options": {"num_cpus": s.replica_cpus},
        # a replica is offered what its engine holds, running and waiting; past that, on every
        # replica, Serve's queue in the ingress (one for all replicas) holds --max-waiting more, then
        # refuses (429). With feeds, one place more in each: the ingress's feed on a replica, or one
        # feed waiting in the queue for a replica's room
        "max_ongoing_requests": s.engine.max_num_seqs + s.engine.max_waiting + int(s.feeds),
        "max_queued_requests": max(1, s.engine.max_waiting) + int(s.feeds),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": s.shutdown_grace,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
    }
    if s.autoscaling:
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=s.min_replicas if s.min_replicas is not None else 1,
            max_replicas=s.max_replicas,
            initial_replicas=s.replicas,
            target_ongoing_requests=s.target_ongoing_requests,
        )
    else:
        opts["num_replicas"] = s.replicas
    # every policy through our router class, which sends each ingress's feed to its replica (pow2 there is
    # Ray Serve's own choice: two replicas at random, the shorter queue by Serve's probes)
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class=KVCacheRequestRouter,
        request_router_kwargs={
            "policy": s.router,
            "block_size": s.engine.block_size,
            "imbalance_threshold": s.imbalance_threshold,
        },
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=5.0,
    )
    return opts


@serve.ingress()
class Ingress:
    """The HTTP API over the replicas."""

    def __init__(self, replicas, settings: ClusterSettings) -> None:
        self.settings = settings
        # Serve runs __init__ on the loop that serves the requests
        self.client = RayEngineClient(
            replicas,
            engine_args_of(settings),
            lambda: ROUTERS.get(REPLICA_DEPLOYMENT),
            asyncio.get_running_loop(),
            feeds=settings.feeds,
        )
        self._load_failed: str | None = None  # why the app's load (its warmup call through the handle) failed
        self._asgi = None  # the app Serve serves, once built

    async def begin_shutdown(self) -> None:
        """`python -m server.cluster`'s SIGTERM, through the app's handle, before Serve stops: from now on
        /health and new requests answer 503, and this returns once every request in flight has had its last
        event (each within --shutdown-grace, then a 'shutdown' error event from its replica, as `python -m
        server` drains: `RayEngineClient.drain`) and the replicas' feeds are closed."""
        state = self._asgi.state.kvserve if self._asgi is not None else None
        if state is None:
            return
        state.begin_shutdown()
        if state.engine is not None:  # loaded: its drain runs
            await asyncio.to_thread(self.client.drained.wait, self.settings.shutdown_grace + DRAIN_MARGIN_S + 5.0)

    async def check_health(self) -> None:
        """Ray Serve's health check: an ingress whose warmup call failed (a replica lost as it started) would
        answer 503 for good, so Serve restarts it instead, and the new one warms up again."""
        if self._load_failed is not None:
            raise RuntimeError(f"the ingress did not load: {self._load_failed}")

    def ready_replicas(self) -> int:
        """Replicas this ingress may send requests to: those Serve lists as running to its router (pushed by
        Serve's controller as they start and stop, no poll), less those a failed call or feed showed dead
        since (`Router.replica_lost`), which Serve notices only at its next health check."""
        router = ROUTERS.get(REPLICA_DEPLOYMENT)
        return len(router.replicas) if router is not None else 0

    def _health(self) -> dict:
        """/health's fields beyond the app's own: a 503 while no replica can take a request (none started
        yet, or all dead and not yet restarted), unless autoscaling may hold none (--min-replicas 0: the
        next request starts one)."""
        s, ready = self.settings, self.ready_replicas()
        wanted = s.max_replicas or s.replicas
        if ready == 0 and not (s.autoscaling and s.min_replicas == 0):
            raise APIError(
                503,
                f"no replica is running ({wanted} wanted): Serve is starting them, or restarting one that died",
                "unavailable",
                headers={"Retry-After": "5"},
            )
        return {"replicas_ready": ready, "replicas_wanted": wanted}

    def __serve_build_asgi_app__(self):
        from server.api.app import create_app

        s = self.settings
        self._asgi = create_app(
            lambda: self.client,
            model_name=s.model_name or Path(s.checkpoint).name,
            warmup=s.warmup,
            limits=s.limits,
            api_key=s.api_key,
            cors_origins=s.cors_origins,
            shutdown_grace=s.shutdown_grace,
            on_load_failure=self._on_load_failure,
            health=self._health,
            extra_metrics=lambda: cluster_metrics(self.client, ROUTERS.get(REPLICA_DEPLOYMENT)),
        )
        return self._asgi

    def _on_load_failure(self, reason: str) -> None:
        self._load_failed = reason


def engine_args_of(s: ClusterSettings) -> EngineArgs:
    return EngineArgs(checkpoint=Path(s.checkpoint), device=s.device, dtype=s.dtype, config=s.engine)


def build_app(s: ClusterSettings):
    engine_args = engine_args_of(s)
    replica = serve.deployment(EngineReplica, name=REPLICA_DEPLOYMENT, **replica_options(s))
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=s.shutdown_grace,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    )
    return ingress.bind(replica.bind(engine_args, s.warmup), s)


def app_builder(args: dict):
    """For `serve run` / `serve deploy` config files: `args` are `python -m server.cluster`'s flags by
    their long names (`checkpoint`, `replicas`, `router`, `kv_cache_memory`...): true for a switch, a list
    for a flag given several values (`served_model_name`) or given several times (`cors_origin`), null for
    the default. The flags of how HTTP comes in (`host`, `port`, `serve_proxy`, `ray_num_cpus`) do nothing
    here: the config's `http_options` and the cluster decide. The flags and the checkpoint are checked as the
    command checks them; a problem is a ValueError whose message says it, which Serve reports as the
    deployment's failure."""
    from server.cli import check_args, cluster_settings_from, parse_cluster_args, replica_device

    argv = argv_of(args)
    try:
        parsed = parse_cluster_args(argv)
    except SystemExit:  # argparse printed why on this process's stderr; the config's reader sees this
        raise ValueError(f"the config's args are not flags of python -m server.cluster: {' '.join(argv)}") from None
    problem = check_args(parsed, engines_here=0, device=replica_device(parsed))  # Serve places the replicas
    if problem is not None:
        raise ValueError(problem[1])
    return build_app(cluster_settings_from(parsed))


def argv_of(args: dict) -> list[str]:
    """A Serve config's `args` as the command line of `python -m server.cluster`."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [a for v in value for a in (flag, str(v))] if key in REPEATED_FLAGS else [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
