"""The API's routes, each a few lines handing the request to the module that serves it: health,
metrics and info; TGI's /generate, /generate_stream and /; OpenAI's /v1/ routes; vLLM's tokenizer routes.
Each declares what it answers (openapi_responses), so /openapi.json describes what the server does."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.api.errors import FAILED_GENERATION, APIError
from server.api.openapi_responses import (
    GENERATION_ERRORS,
    EventStreamResponse,
    PrometheusResponse,
    errors,
    event_stream,
)
from server.api.protocol import GenerateRequest, GenerateResponse, HealthResponse, StreamResponse
from server.api.protocol_openai import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from server.api.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from server.api.serving_chat import chat_completion
from server.api.serving_completions import openai_completion
from server.api.serving_tgi import tgi_generate
from server.api.serving_tokenize import detokenize, tokenize, tokenizer_info
from server.api.state import AppState


def service_router(state: AppState) -> APIRouter:
    """/health, /metrics and /info: what an operator or a load balancer reads."""
    router = APIRouter()

    @router.get("/health", response_model=HealthResponse, responses=errors(503, openai=False))
    async def health():
        state.ready_engine()
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "unavailable")
        return {"status": "ok", **state.health()}

    @router.get("/metrics", response_class=PrometheusResponse, responses=errors(401, openai=False, json_route=False))
    async def metrics():
        return PrometheusResponse(state.metrics.render() + state.extra_metrics().encode())

    @router.get("/info", responses=errors(401, 503, openai=False))
    async def info():
        engine, limits = state.ready_engine(), state.limits
        about = engine.info
        max_input = min(engine.context_length - 1, limits.max_input_tokens or engine.context_length)
        return {
            "model_id": state.model_name,
            "model_dtype": about.model_dtype,
            "model_device_type": about.device_type,
            "max_input_tokens": max_input,
            "max_total_tokens": engine.context_length,
            "max_new_tokens": limits.max_new_tokens,
            "max_stop_sequences": limits.max_stop_sequences,
            "max_batch_size": engine.config.max_num_seqs,
            "max_waiting_requests": engine.config.max_waiting,
            "max_batch_total_tokens": about.num_blocks * about.block_size,
            "block_size": about.block_size,
            "prefix_caching": engine.config.enable_prefix_caching,
            "kernels": about.kernels,
            "kernel_isa": about.kernel_isa,
            "request_timeout_s": limits.request_timeout,
            "router": "kvserve",
        }

    return router


def tgi_router(state: AppState) -> APIRouter:
    """TGI's generation routes."""
    router = APIRouter()

    @router.post(
        "/generate",
        response_model=GenerateResponse,
        responses={
            **event_stream(StreamResponse, False, GenerateResponse),
            **errors(*GENERATION_ERRORS, FAILED_GENERATION, openai=False),
        },
    )
    async def generate(request: Request, body: GenerateRequest):
        """Streams when `stream` is true or the request accepts text/event-stream."""
        stream = body.stream or "text/event-stream" in request.headers.get("accept", "")
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, state.limits, stream=stream)

    @router.post(
        "/generate_stream",
        response_class=EventStreamResponse,
        responses={**event_stream(StreamResponse, False), **errors(*GENERATION_ERRORS, openai=False, json_route=False)},
    )
    async def generate_stream(request: Request, body: GenerateRequest):
        return await tgi_generate(request, body, state.ready_engine(), state.metrics, state.limits, stream=True)

    @router.post(
        "/",
        response_model=list[GenerateResponse],
        responses={
            **event_stream(StreamResponse, False),
            **errors(*GENERATION_ERRORS, FAILED_GENERATION, openai=False),
        },
    )
    async def compat_generate(request: Request, body: GenerateRequest):
        """TGI's compatibility route (huggingface_hub's InferenceClient posts here)."""
        return await tgi_generate(
            request, body, state.ready_engine(), state.metrics, state.limits, stream=body.stream, as_list=True
        )

    return router


def openai_router(state: AppState) -> APIRouter:
    """OpenAI's /v1/ routes."""
    router = APIRouter()
    generation_errors = errors(*GENERATION_ERRORS, 404, openai=True)

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**event_stream(CompletionResponse, True, CompletionResponse), **generation_errors},
    )
    async def completions(request: Request, body: CompletionRequest):
        return await openai_completion(request, body, state.ready_engine(), state.metrics, state.limits, state.names)

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**event_stream(ChatCompletionChunk, True, ChatCompletionResponse), **generation_errors},
    )
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await chat_completion(request, body, state.ready_engine(), state.metrics, state.limits, state.names)

    @router.get("/v1/models", response_model=ModelList, responses=errors(401, 503, openai=True))
    async def models():
        context = state.ready_engine().context_length
        return ModelList(
            data=[ModelCard(id=name, created=state.created, max_model_len=context) for name in state.names.names]
        ).model_dump()

    return router


def tokenizer_router(state: AppState) -> APIRouter:
    """vLLM's tokenizer routes (lm-eval finds them by GET /tokenizer_info and then needs no tokenizer path)."""
    router = APIRouter()
    tokenizer_errors = errors(400, 401, 404, 413, 422, 503, openai=True)

    @router.post("/tokenize", response_model=TokenizeResponse, responses=tokenizer_errors)
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(body, state.ready_engine(), state.names)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=tokenizer_errors)
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(body, state.ready_engine(), state.names)

    @router.get("/tokenizer_info", response_model=TokenizerInfo, responses=errors(401, 503, openai=True))
    async def tokenizer_info_route():
        return tokenizer_info(state.ready_engine())

    return router
