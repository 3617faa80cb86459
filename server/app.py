"""The HTTP app: routes only. The engine is built in a background thread at start-up, so `/health`
answers 503 until the model is loaded and warm, then 200."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine import Engine
from server.metrics import Metrics
from server.playground import router as playground_router
from server.protocol import CompletionRequest, GenerateRequest, ModelCard, ModelList
from server.serving import APIError, openai_completion, tgi_generate

log = logging.getLogger("kvserve.app")


class AppState:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: Engine | None = None  # set once loaded and warm
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics(model_name)

    def ready_engine(self) -> Engine:
        if self.engine is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, message, "unavailable", headers={"Retry-After": "5"})
        return self.engine

    def load(self, load_engine: Callable[[], Engine], warmup: bool) -> None:
        try:
            engine = load_engine().start()
            if warmup:
                engine.warmup()
        except Exception as e:  # noqa: BLE001 - reported by /health, the process stays up to say so
            log.exception("loading the engine failed")
            self.load_error = f"{type(e).__name__}: {e}"
            return
        self.metrics.bind(lambda: engine.num_running, lambda: engine.num_waiting, lambda: engine.kv_cache_usage)
        self.engine = engine
        log.info("model %s ready", self.model_name)


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


def create_app(load_engine: Callable[[], Engine], *, model_name: str = "model", warmup: bool = True) -> FastAPI:
    """An app serving the engine that `load_engine` returns (called once, in a background thread)."""
    state = AppState(model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, args=(load_engine, warmup), name="kvserve-load", daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="kvserve", description="TGI- and OpenAI-compatible text generation", lifespan=lifespan)
    app.state.kvserve = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return APIError(422, _validation_message(exc), "validation").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), "http", headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", "internal").response()

    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=Metrics.CONTENT_TYPE)

    @app.get("/info")
    async def info():
        engine = state.ready_engine()
        return {"model_id": model_name, "model_dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
                "model_device_type": engine.device.type, "max_input_tokens": engine.context_length - 1,
                "max_total_tokens": engine.context_length, "max_batch_size": engine.scheduler.max_running,
                "max_waiting_requests": engine.scheduler.max_waiting, "router": "kvserve"}

    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest):
        stream = body.stream or "text/event-stream" in request.headers.get("accept", "")
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, stream=stream)

    @app.post("/generate_stream")
    async def generate_stream(request: Request, body: GenerateRequest):
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, stream=True)

    @app.post("/")
    async def compat_generate(request: Request, body: GenerateRequest):
        """TGI's compatibility route (huggingface_hub's InferenceClient posts here)."""
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, stream=body.stream,
                                  as_list=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await openai_completion(request, body, state.ready_engine(), state.metrics, model_name)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=model_name, created=state.created, max_model_len=state.ready_engine().context_length)
        return ModelList(data=[card]).model_dump()

    app.include_router(playground_router)  # GET /: the browser playground
    return app
