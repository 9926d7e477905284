"""The gateway's exceptions, and the one place they become OpenAI error objects.

Hierarchy:

    GatewayError                      500 internal_error
    ├── InvalidRequest                400 invalid_request_error (param names the field)
    │   ├── ContextLengthExceeded     400 code=context_length_exceeded (says both numbers)
    │   └── UnknownVariantError       400 code=unknown_variant (operator override header)
    ├── AuthenticationFailed          401 invalid_api_key
    ├── PermissionDenied              403 permission_denied (admin endpoints)
    ├── ModelNotFound                 404 model_not_found
    ├── ResponseNotFound              404 response_not_found (an unknown or expired stored response)
    ├── WorkerNotFound                404 worker_not_found (admin drain)
    ├── GateFailed                    409 shadow_gate_failed (a canary start the shadow's figures do not
    │                                     allow yet, gateway/control/gates.py; the message says why)
    ├── RequestTooLarge               413 request_too_large
    ├── QueueFull                     429 rate_limit_exceeded (max_pending_requests in flight)
    │   ├── RateLimited               429 rate_limit_exceeded (a per-key limit; Retry-After)
    │   ├── QueueWaitTooLong          429 code=queue_wait_exceeded (engines too busy to start it in
    │   │                                 time, gateway/serving/admission.py; Retry-After)
    │   └── EngineBusy                429 code=engine_overloaded (the worker refused it for load; not
    │                                     retried elsewhere, Retry-After: 1)
    ├── NoCapableWorkerError          503 service_unavailable (no capable healthy worker)
    ├── StateStoreUnavailable         503 state_unavailable (an admin change could not reach Redis)
    ├── EngineFailure                 502 engine_error (every attempt failed / failed mid-stream)
    └── RequestTimeout                408 timeout (the client's own `timeout` passed; the engine aborted it)

Raise these anywhere in the request path; `error_response` (for HTTP) and `error_payload` (for an
SSE error event) are the only code that knows the wire shape, `anthropic_payload` and
`anthropic_response` the Anthropic Messages API's (`/v1/messages*`, where `error_response_for`
picks it by path); `http_exception_response` gives
Starlette's routing errors (404 unknown path, 405 wrong method) the same shape.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class GatewayError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"

    def __init__(self, num_tokens: int, max_len: int, param: str = "messages") -> None:
        super().__init__(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{num_tokens} tokens (prompt plus max_tokens). Please reduce the length of the messages "
            f"or completion.",
            param,
        )
        self.num_tokens = num_tokens
        self.max_len = max_len


class UnknownVariantError(InvalidRequest):
    code = "unknown_variant"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or you do not have access to it.", "model")


class ResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "response_not_found"

    def __init__(self, response_id: str, param: str | None = None) -> None:
        super().__init__(f"No response with id '{response_id}' is stored (unknown, deleted, expired, or made "
                         "with store: false).", param)


class WorkerNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "worker_not_found"


class GateFailed(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "shadow_gate_failed"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class QueueFull(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"
    headers = {"retry-after": "1"}  # noqa: RUF012 - read only


class RateLimited(QueueFull):
    """A per-API-key limit (gateway/control/limits.py); `retry_after_s` goes out as the Retry-After header."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.headers = {"retry-after": str(retry_after_s)}


class QueueWaitTooLong(QueueFull):
    """Admission control (gateway/serving/admission.py): the estimated wait is over the bound; nothing started."""

    code = "queue_wait_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.headers = {"retry-after": str(retry_after_s)}


class EngineBusy(QueueFull):
    """The chosen worker refused the request for load (gateway/serving/dispatch.py): answered, never re-sent."""

    code = "engine_overloaded"


class NoCapableWorkerError(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_capable_worker"


class StateStoreUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "state_unavailable"


class EngineFailure(GatewayError):
    status = 502
    type = "engine_error"
    code = "engine_error"


class RequestTimeout(GatewayError):
    status = 408
    type = "timeout"
    code = "timeout"


async def http_exception_response(request, exc) -> JSONResponse:
    """Starlette's own 404 (no such path) and 405 (wrong method) as OpenAI error objects too."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    err = GatewayError(f"{exc.detail}: {request.method} {request.url.path}")
    err.status, err.type, err.code = exc.status_code, "invalid_request_error", codes.get(exc.status_code)
    return error_response_for(request.url.path, err, dict(exc.headers or {}))


def error_payload(exc: GatewayError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: GatewayError, headers: dict[str, str] | None = None) -> JSONResponse:
    own = getattr(exc, "headers", None)  # e.g. Retry-After of a 429
    return JSONResponse(error_payload(exc), status_code=exc.status, headers={**(headers or {}), **own} if own
                        else headers)


# The Anthropic Messages API's error types, by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    502: "api_error", 503: "overloaded_error"}


def anthropic_payload(exc: GatewayError) -> dict:
    message = f"{exc.param}: {exc.message}" if exc.param and not exc.message.startswith(exc.param) else exc.message
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": message}}


def anthropic_response(exc: GatewayError, headers: dict[str, str] | None = None) -> JSONResponse:
    own = getattr(exc, "headers", None)
    return JSONResponse(anthropic_payload(exc), status_code=exc.status,
                        headers={**(headers or {}), **own} if own else headers)


def error_response_for(path: str, exc: GatewayError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the API this path belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_response(exc, headers)
    return error_response(exc, headers)
