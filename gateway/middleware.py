"""The gateway's ASGI middleware, outermost first: request id, error shield, tracing, body limit, API keys.

Each is a plain class with `__call__(scope, receive, send)`. They put what the handlers need in
`scope["state"]` (Starlette's `request.state`): `request_id`, `cache_salt`, `api_key_id`.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import uuid

from opentelemetry import trace
from opentelemetry.propagate import extract

from gateway.control.limits import api_key_id
from gateway.errors import (
    AuthenticationFailed,
    GatewayError,
    RequestTooLarge,
    error_payload,
    error_response_for,
)

log = logging.getLogger("duet.gateway")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


async def _reject(exc: GatewayError, scope, receive, send) -> None:
    await error_response_for(scope.get("path", ""), exc)(scope, receive, send)


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's (when sane) or a fresh one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        rid = given if given and _SAFE_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ErrorShieldMiddleware:
    """The last line of the edge's contract, "every answer is 2xx or an OpenAI error object": an
    exception no handler turned into a GatewayError becomes a 500 `internal_error` object (logged with
    its traceback) instead of Starlette's plain-text page; once an SSE stream has started, the stream
    ends with an error event and `[DONE]` instead of being cut."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = {"sse": None}

        async def send_tracked(message) -> None:
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers", ())).get(b"content-type", b"")
                started["sse"] = ctype.startswith(b"text/event-stream")
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:  # the catch-all, by design
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            err = GatewayError(f"internal error: {type(e).__name__}")
            if started["sse"] is None:
                return await error_response_for(scope.get("path", ""), err)(scope, receive, send)
            tail = b""
            if started["sse"]:
                tail = b"data: " + json.dumps(error_payload(err)).encode() + b"\n\ndata: [DONE]\n\n"
            with contextlib.suppress(Exception):  # the client may be gone already
                await send({"type": "http.response.body", "body": tail, "more_body": False})


class TracingMiddleware:
    """A server span per HTTP request, child of the caller's W3C `traceparent` when given."""

    def __init__(self, app, tracer_provider=None) -> None:
        self.app = app
        self.tracer = trace.get_tracer("duet.gateway", tracer_provider=tracer_provider)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        name = f"{scope['method']} {scope['path']}"
        with self.tracer.start_as_current_span(name, context=extract(carrier), kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", scope["method"])
            span.set_attribute("url.path", scope["path"])

            async def send_traced(message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_traced)


class BodyLimitMiddleware:
    """Reads request bodies up to `max_bytes` (413 beyond), then replays them to the app; later
    `receive()` calls go to the server, so a streaming handler still sees the client disconnect."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = RequestTooLarge(f"request body over the limit of {self.max_bytes} bytes")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _reject(too_large, scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _reject(too_large, scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKeyMiddleware:
    """Bearer API keys for `/v1/*` when any are configured (or `x-api-key`, as Anthropic clients send
    it); constant-time comparison against every key (no early exit). The matching key's `cache_salt` goes to `scope["state"]`."""

    def __init__(self, app, api_keys: dict[str, str]) -> None:
        self.app = app
        self.keys = [(k.encode(), salt) for k, salt in api_keys.items()]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state.setdefault("cache_salt", "")
        if not self.keys:
            return await self.app(scope, receive, send)
        auth = _header(scope, b"authorization") or ""
        token = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        if not token:  # Anthropic clients send the key as x-api-key
            token = (_header(scope, b"x-api-key") or "").strip().encode()
        salt = None
        for key, key_salt in self.keys:
            if hmac.compare_digest(key, token) and salt is None:
                salt = key_salt
        if salt is None:
            msg = "Incorrect API key provided." if token else "Missing API key: send 'Authorization: Bearer <key>'."
            return await _reject(AuthenticationFailed(msg), scope, receive, send)
        state["cache_salt"] = salt
        state["api_key_id"] = api_key_id(token)
        await self.app(scope, receive, send)
