"""How the app answers what a route did not: an APIError, a body that fails validation, starlette's own
HTTP errors (404, 405) and anything unexpected, each in the error shape of the route's API."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.errors import APIError, is_openai_path, route_path
from server.api.metrics import Metrics

log = logging.getLogger("kvserve.app")


def _openai_route(request: Request) -> bool:
    """OpenAI's routes answer errors in OpenAI's shape, which its clients read; the others in TGI's."""
    return is_openai_path(route_path(request.scope))


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"the body is not valid JSON: {reason} at character {err['loc'][-1]}")
            continue
        # a check over the whole body (protocol.Strict's) names the field it refused in its context
        field = (err.get("ctx") or {}).get("field")
        loc = field or ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid').removeprefix('Value error, ')}")
    return "; ".join(parts)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.reason:
            metrics.on_rejected(exc.reason)
        return exc.response(openai=_openai_route(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        metrics.on_rejected("validation")
        return APIError(422, _validation_message(exc), "validation").response(openai=_openai_route(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, RecursionError):
            # FastAPI answers 400 for any failure to parse a body; JSON nested past the parser's depth is
            # invalid input like any other malformed JSON (422, OpenAI's 400), not a body that is not UTF-8
            metrics.on_rejected("validation")
            message = "the body is not JSON this server reads: its arrays and objects nest too deeply"
            return APIError(422, message, "validation").response(openai=_openai_route(request))
        return APIError(exc.status_code, str(exc.detail), "http", headers=exc.headers).response(
            openai=_openai_route(request)
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", "internal").response(
            openai=_openai_route(request)
        )
