"""What the app holds across requests: the engine once loaded, the limits, the metrics, shutdown."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

from server.api.engine_client import EngineClient
from server.api.errors import APIError
from server.api.limits import Limits
from server.api.metrics import Metrics
from server.api.model_names import ServedNames

log = logging.getLogger("kvserve.app")


class AppState:
    def __init__(
        self,
        names: ServedNames,
        limits: Limits,
        shutdown_grace: float,
        on_load_failure: Callable[[str], None] | None = None,
        health: Callable[[], dict] | None = None,
        extra_metrics: Callable[[], str] | None = None,
    ) -> None:
        """`on_load_failure(reason)`: called when the engine does not load (the CLI exits); without it the
        app stays up and /health reports the reason."""
        self.names, self.limits, self.shutdown_grace = names, limits, shutdown_grace
        self.on_load_failure = on_load_failure
        self.health = health or dict  # more fields for /health's answer
        self.extra_metrics = extra_metrics or str  # more text for /metrics
        self.model_name = names.primary  # what answers and metrics call the model
        self.engine: EngineClient | None = None  # set once loaded and warm
        self.load_error: str | None = None
        self.shutting_down = False
        self.created = int(time.time())
        self.metrics = Metrics(self.model_name)

    def begin_shutdown(self) -> None:
        """From now on /health and new requests answer 503; requests in flight get `shutdown_grace`
        seconds to finish, then end with an error event of type 'shutdown' (`EngineClient.drain`)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: no new requests; %g s for those in flight", self.shutdown_grace)
        if self.engine is not None:
            threading.Thread(
                target=self.engine.drain, args=(self.shutdown_grace,), name="kvserve-drain", daemon=True
            ).start()

    def ready_engine(self) -> EngineClient:
        if self.engine is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, message, "unavailable", headers={"Retry-After": "5"})
        return self.engine

    def load(self, load_engine: Callable[[], EngineClient], warmup: bool) -> None:
        try:
            engine = load_engine().start()
            if warmup:
                engine.warmup()
        except Exception as e:  # noqa: BLE001 - reported by /health, or on_load_failure ends the process
            self.load_error = f"{type(e).__name__}: {e}"
            # one line; the traceback only when debugging
            log.error("loading the engine failed: %s", self.load_error, exc_info=log.isEnabledFor(logging.DEBUG))
            if self.on_load_failure is not None:
                self.on_load_failure(self.load_error)
            return
        # What loading left lives as long as the process: frozen out of the collector's way, so that a full
        # collection while serving (it holds every thread, the engine's too) scans only what came since
        # (BENCHMARKS.md); vLLM freezes its heap after startup too.
        gc.collect()
        gc.freeze()
        self.metrics.bind(
            lambda: engine.num_running, lambda: engine.num_waiting, lambda: engine.kv_cache_usage, engine.counters
        )
        self.metrics.describe(engine.info)
        self.metrics.bind_steps(engine.step_stats_snapshot)  # a local Engine's, or the replicas' summed
        self.engine = engine
        log.info("model %s ready", self.model_name)
