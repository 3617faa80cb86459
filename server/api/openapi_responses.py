"""What the OpenAPI schema says each route answers besides its 200: the error statuses it can give, each in
its route's error shape, and the content types of streams (text/event-stream) and metrics (Prometheus
text). FastAPI's own guess (a JSON 200, and a 422 in a shape this server never sends) is replaced."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.api.errors import is_openai_path, openai_status
from server.api.metrics import Metrics
from server.api.protocol import ErrorResponse, StreamResponse
from server.api.protocol_openai import ChatCompletionChunk, CompletionResponse

EVENT_STREAM = "text/event-stream"


class OpenAIErrorBody(BaseModel):
    message: str
    type: str  # OpenAI's: invalid_request_error, rate_limit_error or server_error
    param: str | None = None
    code: str  # OpenAI's code where it has one (context_length_exceeded, model_not_found, invalid_api_key), else
    # this server's kind of error: validation, overloaded, unavailable, timeout, ...


class OpenAIErrorResponse(BaseModel):
    """OpenAI's error shape, on /v1/ and vLLM's tokenizer routes."""

    error: OpenAIErrorBody


class EventStreamResponse(StreamingResponse):
    media_type = EVENT_STREAM


class PrometheusResponse(Response):
    media_type = Metrics.CONTENT_TYPE


WHY = {
    400: "a body that is not UTF-8, a chat template that fails or has a non-text content part",
    401: "--api-key is set and the request lacks 'Authorization: Bearer <key>'",
    404: "a model name this server does not serve (see --served-model-name)",
    413: "a body larger than --max-body-bytes",
    424: "the generation failed (TGI's GenerationError: error_type 'generation')",
    422: "JSON that does not parse (or nests too deeply), a field out of range or a string that is not Unicode "
    "text (a lone UTF-16 surrogate), a limit of this server passed (each names its flag), or a prompt too long "
    "for the context",
    429: "the queue is full (--max-waiting); Retry-After says when to try again",
    503: "the model is loading, or the server is shutting down; Retry-After says when to try again",
    504: "the request's own deadline (timeout, at most --request-timeout) passed before it finished",
}


def errors(*statuses: int, openai: bool, json_route: bool = True) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses, in the route's error shape (JSON). On a route whose 200 is
    not JSON (`json_route` false), the schema is named outright, as FastAPI would give it the 200's type."""
    model = OpenAIErrorResponse if openai else ErrorResponse
    if openai:  # OpenAI's 400 covers what TGI answers with 422
        statuses = tuple(sorted({openai_status(status) for status in statuses}))
    if json_route:
        return {status: {"model": model, "description": _why(status, openai)} for status in statuses}
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
    return {status: {"content": content, "description": _why(status, openai)} for status in statuses}


def _why(status: int, openai: bool) -> str:
    return f"{WHY[400]}; {WHY[422]}" if openai and status == 400 else WHY[status]


EVENT_MODELS = (StreamResponse, CompletionResponse, ChatCompletionChunk, ErrorResponse, OpenAIErrorResponse)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json_data(*models: type[BaseModel]) -> dict[str, Any]:
    return {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(m) for m in models]},
    }


def json_events(event: type[BaseModel]) -> dict[str, Any]:
    """The schema of one Server-Sent Event whose `data` is an `event` as JSON (OpenAPI 3.1 reads a stream's
    schema as one event's)."""
    return {"type": "object", "required": ["data"], "properties": {"data": _json_data(event)}}


def event_stream(
    event: type[BaseModel], openai: bool, also_json: type[BaseModel] | None = None
) -> dict[int | str, dict[str, Any]]:
    """A 200 that is a stream of Server-Sent Events, each `data:` one `event` (or, last, an error in the
    route's shape; OpenAI's streams end with `data: [DONE]`); with `also_json`, either that JSON or the
    stream, as the request asks. Per OpenAPI 3.1, the schema describes one event."""
    error = OpenAIErrorResponse if openai else ErrorResponse
    data = {"anyOf": [{"const": "[DONE]"}, _json_data(event, error)]} if openai else _json_data(event, error)
    schema = {"type": "object", "required": ["data"], "properties": {"data": data}}
    content: dict[str, Any] = {EVENT_STREAM: {"schema": schema}}
    if also_json is not None:
        content["application/json"] = {"schema": _ref(also_json)}
    return {
        200: {
            "content": content,
            "description": "the answer, or with stream (or Accept: text/event-stream on /generate) its events",
        }
    }


def with_event_schemas(app: FastAPI) -> None:
    """The app's /openapi.json also defines the event models the streams refer to (no route returns them
    as JSON, so FastAPI would leave them out), and OpenAI's routes declare no 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path, operations in schema.get("paths", {}).items():  # FastAPI's own 422, which OpenAI's routes
                if is_openai_path(path):  # never answer (their 400 says it)
                    for operation in operations.values():
                        operation.get("responses", {}).pop("422", None)
            if "HTTPValidationError" not in json.dumps(schema["paths"]):  # FastAPI's shape, now referred to by none
                for name in ("HTTPValidationError", "ValidationError"):
                    schema.get("components", {}).get("schemas", {}).pop(name, None)
            _, defs = models_json_schema(
                [(m, "serialization") for m in EVENT_MODELS], ref_template="#/components/schemas/{model}"
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


GENERATION_ERRORS = (400, 401, 413, 422, 429, 503, 504)  # what a generation route can answer
