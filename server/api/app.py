"""The HTTP app: its routes, the guards in front of them (API key, body size, CORS), and the uvicorn server
that shuts it down gracefully. The engine is built in a background thread at start-up, so `/health`
answers 503 until the model is loaded and warm, then 200, and 503 again once shutdown begins."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.api.engine_client import EngineClient
from server.api.error_handlers import add_error_handlers
from server.api.kv_routes import router as kv_router
from server.api.limits import Limits
from server.api.middleware import BearerAuth, BodySizeLimit
from server.api.model_names import ServedNames
from server.api.openapi_responses import with_event_schemas
from server.api.playground import router as playground_router
from server.api.routes import openai_router, service_router, tgi_router, tokenizer_router
from server.api.state import AppState


def create_app(
    load_engine: Callable[[], EngineClient],
    *,
    model_name: str | Sequence[str] = "model",
    warmup: bool = True,
    limits: Limits = Limits(),
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    shutdown_grace: float = 30.0,
    on_load_failure: Callable[[str], None] | None = None,
    health: Callable[[], dict] | None = None,
    extra_metrics: Callable[[], str] | None = None,
) -> FastAPI:
    """An app serving the engine that `load_engine` returns (called once, in a background thread): the
    local Engine, or the cluster's RayEngineClient (server/api/engine_client.py).
    With `api_key`, every route but /health and the playground page needs it as a Bearer token.
    `cors_origins`: browser origins allowed to call the API (none by default). `model_name`: the served
    name, or several (--served-model-name), the first of which answers report. `on_load_failure(reason)`
    is called if the engine does not load (the CLI exits); without it /health reports the reason.
    `health` adds its fields to /health's answer and `extra_metrics` its text to /metrics (the cluster's
    replicas and router)."""
    state = AppState(ServedNames.of(model_name), limits, shutdown_grace, on_load_failure, health, extra_metrics)
    app = FastAPI(
        title="kvserve",
        description="TGI- and OpenAI-compatible text generation",
        lifespan=_lifespan(state, load_engine, warmup),
    )
    app.state.kvserve = state
    _add_guards(app, state, api_key, cors_origins)
    add_error_handlers(app, state.metrics)
    for router in (service_router(state), tgi_router(state), openai_router(state), tokenizer_router(state)):
        app.include_router(router)
    app.include_router(kv_router)  # GET /kv, /kv/stream: the KV-cache block pool
    app.include_router(playground_router)  # GET /: the browser playground
    with_event_schemas(app)
    return app


def _lifespan(state: AppState, load_engine: Callable[[], EngineClient], warmup: bool):
    """Loads the engine in a background thread at start-up (so /health answers meanwhile); shuts it down at exit.
    A stop asked for while it loads waits for the loading to end, then stops what loaded: an interpreter that
    exits under a thread still inside torch's kernels aborts ('terminate called without an active exception')."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = threading.Thread(target=state.load, args=(load_engine, warmup), name="kvserve-load", daemon=True)
        loading.start()
        yield
        await asyncio.to_thread(loading.join)
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    return lifespan


def _add_guards(app: FastAPI, state: AppState, api_key: str | None, cors_origins: Sequence[str]) -> None:
    # the last added runs first: CORS (so refusals carry its headers), then the key, then the body size
    app.add_middleware(BodySizeLimit, max_bytes=state.limits.max_body_bytes, on_reject=state.metrics.on_rejected)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, on_reject=state.metrics.on_rejected)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Accept"],
        )


class GracefulServer(uvicorn.Server):
    """uvicorn, with the app told first on SIGTERM or SIGINT (`AppState.begin_shutdown`), so requests in
    flight finish or end with a 'shutdown' event while uvicorn waits for their connections. A SIGTERM
    is not raised again once the server has stopped, so the process exits with status 0."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn names the address only of sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state: AppState | None = getattr(getattr(self.config.app, "state", None), "kvserve", None)
        if state is not None:
            state.begin_shutdown()
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)
