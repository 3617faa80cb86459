"""The HTTP app: routes, the guards in front of them (API key, body size, CORS), and the uvicorn server
that shuts it down gracefully. The engine is built in a background thread at start-up, so `/health`
answers 503 until the model is loaded and warm, then 200, and 503 again once shutdown begins."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.engine_client import EngineClient
from server.api.errors import is_openai_path
from server.api.kv_routes import router as kv_router
from server.api.metrics import Metrics
from server.api.middleware import BearerAuth, BodySizeLimit
from server.api.playground import router as playground_router
from server.api.protocol import GenerateRequest
from server.api.protocol_openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.api.serving import APIError, Limits
from server.api.serving_chat import chat_completion
from server.api.serving_completions import openai_completion
from server.api.serving_tgi import tgi_generate

log = logging.getLogger("kvserve.app")


class AppState:
    def __init__(self, model_name: str, limits: Limits, shutdown_grace: float,
                 health: Callable[[], dict] | None = None, extra_metrics: Callable[[], str] | None = None) -> None:
        self.model_name, self.limits, self.shutdown_grace = model_name, limits, shutdown_grace
        self.health = health or dict  # more fields for /health's answer
        self.extra_metrics = extra_metrics or str  # more text for /metrics
        self.engine: EngineClient | None = None  # set once loaded and warm
        self.load_error: str | None = None
        self.shutting_down = False
        self.created = int(time.time())
        self.metrics = Metrics(model_name)

    def begin_shutdown(self) -> None:
        """From now on /health and new requests answer 503; requests in flight get `shutdown_grace`
        seconds to finish, then end with an error event of type 'shutdown' (`EngineClient.drain`)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: no new requests; %g s for those in flight", self.shutdown_grace)
        if self.engine is not None:
            threading.Thread(target=self.engine.drain, args=(self.shutdown_grace,), name="kvserve-drain",
                             daemon=True).start()

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
        except Exception as e:  # noqa: BLE001 - reported by /health, the process stays up to say so
            log.exception("loading the engine failed")
            self.load_error = f"{type(e).__name__}: {e}"
            return
        # What loading left lives as long as the process: frozen out of the collector's way, so that a full
        # collection while serving (it holds every thread, the engine's too) scans only what came since
        # (BENCHMARKS.md); vLLM freezes its heap after startup too.
        gc.collect()
        gc.freeze()
        self.metrics.bind(lambda: engine.num_running, lambda: engine.num_waiting, lambda: engine.kv_cache_usage,
                          engine.counters)
        self.engine = engine
        log.info("model %s ready", self.model_name)


def _openai_route(request: Request) -> bool:
    """OpenAI's routes answer errors in OpenAI's shape, which its clients read; the others in TGI's."""
    return is_openai_path(request.url.path)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"the body is not valid JSON: {reason} at character {err['loc'][-1]}")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid').removeprefix('Value error, ')}")
    return "; ".join(parts)


def create_app(load_engine: Callable[[], EngineClient], *, model_name: str = "model", warmup: bool = True,
               limits: Limits = Limits(), api_key: str | None = None, cors_origins: Sequence[str] = (),
               shutdown_grace: float = 30.0, health: Callable[[], dict] | None = None,
               extra_metrics: Callable[[], str] | None = None) -> FastAPI:
    """An app serving the engine that `load_engine` returns (called once, in a background thread): the
    local Engine, or the cluster's RayEngineClient (server/api/engine_client.py).
    With `api_key`, every route but /health and the playground page needs it as a Bearer token.
    `cors_origins`: browser origins allowed to call the API (none by default). `health` adds its fields
    to /health's answer and `extra_metrics` its text to /metrics (the cluster's replicas and router)."""
    state = AppState(model_name, limits, shutdown_grace, health, extra_metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, args=(load_engine, warmup), name="kvserve-load", daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="kvserve", description="TGI- and OpenAI-compatible text generation", lifespan=lifespan)
    app.state.kvserve = state
    # the last added runs first: CORS (so refusals carry its headers), then the key, then the body size
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes, on_reject=state.metrics.on_rejected)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, on_reject=state.metrics.on_rejected)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "Accept"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.reason:
            state.metrics.on_rejected(exc.reason)
        return exc.response(openai=_openai_route(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        state.metrics.on_rejected("validation")
        return APIError(422, _validation_message(exc), "validation").response(openai=_openai_route(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), "http", headers=exc.headers).response(
            openai=_openai_route(request))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", "internal").response(
            openai=_openai_route(request))

    @app.get("/health")
    async def health():
        state.ready_engine()
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "unavailable")
        return {"status": "ok", **state.health()}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render() + state.extra_metrics().encode(), media_type=Metrics.CONTENT_TYPE)

    @app.get("/info")
    async def info():
        engine = state.ready_engine()
        about = engine.info
        max_input = min(engine.context_length - 1, limits.max_input_tokens or engine.context_length)
        return {"model_id": model_name, "model_dtype": about.model_dtype, "model_device_type": about.device_type,
                "max_input_tokens": max_input, "max_total_tokens": engine.context_length,
                "max_new_tokens": limits.max_new_tokens, "max_stop_sequences": limits.max_stop_sequences,
                "max_batch_size": engine.config.max_num_seqs, "max_waiting_requests": engine.config.max_waiting,
                "max_batch_total_tokens": about.num_blocks * about.block_size,
                "block_size": about.block_size, "prefix_caching": engine.config.enable_prefix_caching,
                "kernels": about.kernels,
                "request_timeout_s": limits.request_timeout, "router": "kvserve"}

    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest):
        stream = body.stream or "text/event-stream" in request.headers.get("accept", "")
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, limits, stream=stream)

    @app.post("/generate_stream")
    async def generate_stream(request: Request, body: GenerateRequest):
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, limits, stream=True)

    @app.post("/")
    async def compat_generate(request: Request, body: GenerateRequest):
        """TGI's compatibility route (huggingface_hub's InferenceClient posts here)."""
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, limits, stream=body.stream,
                                  as_list=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await openai_completion(request, body, state.ready_engine(), state.metrics, limits, model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await chat_completion(request, body, state.ready_engine(), state.metrics, limits, model_name)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=model_name, created=state.created, max_model_len=state.ready_engine().context_length)
        return ModelList(data=[card]).model_dump()

    app.include_router(kv_router)  # GET /kv, /kv/stream: the KV-cache block pool
    app.include_router(playground_router)  # GET /: the browser playground
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, with the app told first on SIGTERM or SIGINT (`AppState.begin_shutdown`), so requests in
    flight finish or end with a 'shutdown' event while uvicorn waits for their connections. A SIGTERM
    is not raised again once the server has stopped, so the process exits with status 0."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state: AppState | None = getattr(getattr(self.config.app, "state", None), "kvserve", None)
        if state is not None:
            state.begin_shutdown()
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)
