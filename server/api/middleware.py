"""Pure ASGI middleware that guards the app before any route runs: the API key and the body size.
Both answer in the app's error shapes (TGI's, or OpenAI's on /v1/) and report each refusal
through `on_reject(reason)`, which the app wires to /metrics."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import error_body, is_openai_path, route_path

PUBLIC_PATHS = ("/health",)  # open without the key, for load balancers and orchestrators
PUBLIC_PAGE = ("/", "/favicon.ico")  # the playground page and its icon: no data in them; the API calls need the key
PUBLIC_ASSETS = "/static/"  # the page's files
DRAIN_LIMIT = 64 * 2**20  # bytes of a refused body read and dropped so that the 413 reaches the client


async def send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    error_type: str,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> None:
    body = json.dumps(error_body(status, message, error_type, is_openai_path(route_path(scope)), code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _is_public(scope: Scope) -> bool:
    path, method = route_path(scope), scope.get("method", "GET")
    if path in PUBLIC_PATHS:
        return True
    return method in ("GET", "HEAD") and (path in PUBLIC_PAGE or path.startswith(PUBLIC_ASSETS))


class BearerAuth:
    """Every route but `/health` and the playground's page needs `Authorization: Bearer <key>`;
    anything else is 401. The key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[str], None] = lambda reason: None) -> None:
        self.app, self.on_reject = app, on_reject
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_public(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self.on_reject("unauthorized")
        await send_error(
            scope,
            send,
            401,
            "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
            "unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
            code="invalid_api_key",
        )

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest on the whole token even for a wrong scheme, so the time says nothing about the key
        return hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"


class BodySizeLimit:
    """Refuses a body over `max_bytes` with 413 before the app reads any of it: at once from its
    Content-Length, or by counting the bytes of a chunked one as they arrive. The body is read here
    in full (it is small by then) and handed to the app as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[str], None] = lambda reason: None) -> None:
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send, receive)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, send, receive if message.get("more_body", False) else None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # after the body: http.disconnect, which streaming handlers watch for

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, receive: Receive | None) -> None:
        """Discards what is left of the body (up to DRAIN_LIMIT bytes) before answering: a server that
        closes a connection with unread bytes in it resets it, and the client then sees a broken
        connection instead of the 413. Past the limit the connection is closed all the same."""
        drained = 0
        while receive is not None and drained < DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left: no one to answer
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.on_reject("body_too_large")
        await send_error(
            scope,
            send,
            413,
            f"the request body is larger than the limit of {self.max_bytes} bytes (--max-body-bytes)",
            "body_too_large",
            headers={"Connection": "close"},
        )
