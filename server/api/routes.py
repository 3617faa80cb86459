"""The API's routes, each a few lines handing the request to the module that serves it: health,
metrics and info; TGI's /generate, /generate_stream and /; OpenAI's /v1/ routes."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import APIError
from server.api.metrics import Metrics
from server.api.protocol import GenerateRequest
from server.api.protocol_openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.api.serving_chat import chat_completion
from server.api.serving_completions import openai_completion
from server.api.serving_tgi import tgi_generate
from server.api.state import AppState


def service_router(state: AppState) -> APIRouter:
    """/health, /metrics and /info: what an operator or a load balancer reads."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        state.ready_engine()
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "unavailable")
        return {"status": "ok", **state.health()}

    @router.get("/metrics")
    async def metrics():
        return Response(state.metrics.render() + state.extra_metrics().encode(), media_type=Metrics.CONTENT_TYPE)

    @router.get("/info")
    async def info():
        engine, limits = state.ready_engine(), state.limits
        about = engine.info
        max_input = min(engine.context_length - 1, limits.max_input_tokens or engine.context_length)
        return {"model_id": state.model_name, "model_dtype": about.model_dtype, "model_device_type": about.device_type,
                "max_input_tokens": max_input, "max_total_tokens": engine.context_length,
                "max_new_tokens": limits.max_new_tokens, "max_stop_sequences": limits.max_stop_sequences,
                "max_batch_size": engine.config.max_num_seqs, "max_waiting_requests": engine.config.max_waiting,
                "max_batch_total_tokens": about.num_blocks * about.block_size,
                "block_size": about.block_size, "prefix_caching": engine.config.enable_prefix_caching,
                "kernels": about.kernels,
                "request_timeout_s": limits.request_timeout, "router": "kvserve"}

    return router


def tgi_router(state: AppState) -> APIRouter:
    """TGI's generation routes."""
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request, body: GenerateRequest):
        stream = body.stream or "text/event-stream" in request.headers.get("accept", "")
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, state.limits, stream=stream)

    @router.post("/generate_stream")
    async def generate_stream(request: Request, body: GenerateRequest):
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, state.limits, stream=True)

    @router.post("/")
    async def compat_generate(request: Request, body: GenerateRequest):
        """TGI's compatibility route (huggingface_hub's InferenceClient posts here)."""
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, state.limits,
                                  stream=body.stream, as_list=True)

    return router


def openai_router(state: AppState) -> APIRouter:
    """OpenAI's /v1/ routes."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await openai_completion(request, body, state.ready_engine(), state.metrics, state.limits,
                                       state.model_name)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await chat_completion(request, body, state.ready_engine(), state.metrics, state.limits,
                                     state.model_name)

    @router.get("/v1/models")
    async def models():
        card = ModelCard(id=state.model_name, created=state.created, max_model_len=state.ready_engine().context_length)
        return ModelList(data=[card]).model_dump()

    return router
