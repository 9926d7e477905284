"""The OpenAPI 3.1 document of the public API, served at `GET /openapi.json`.

The request schemas are generated from the pydantic models of gateway/api_models.py (one
description of every field and range); this module only lays out the paths around them. Each error
status answers `ErrorResponse` (OpenAI's shape, gateway/errors.py), or `AnthropicError` on
/v1/messages*. A client generator or the fuzzer (tests/gateway/test_fuzz_openapi.py drives
schemathesis from it) sees what the gateway accepts. The admin API is operator-only and left out.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.api_models import REQUEST_MODELS

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_REASONS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or id",
            413: "body too large", 429: "rate limited (Retry-After)", 500: "gateway bug",
            502: "every worker failed", 503: "no worker can serve it, or the state store is down"}
_GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 502, 503)


def _errors(statuses, schema: str = "ErrorResponse") -> dict:
    ref = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
    return {str(s): {"description": _REASONS[s], **ref} for s in statuses}


def _ok(description: str = "ok", stream: bool = False) -> dict:
    content = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"200": {"description": description, "content": content}}


def _post(summary: str, schema: str, statuses=_GENERATION_ERRORS, stream: bool = False,
          error_schema: str = "ErrorResponse") -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {**_ok("the answer (JSON), or server-sent events when stream", stream),
                      **_errors(statuses, error_schema)},
    }}


def _get(summary: str, *statuses: int) -> dict:
    return {"get": {"summary": summary, "responses": {**_ok(), **_errors(statuses)}}}


def _by_id(name: str, get_summary: str, delete_summary: str | None = None) -> dict:
    param = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]
    item = {"get": {"summary": get_summary, "parameters": param, "responses": {**_ok(), **_errors((401, 404))}}}
    if delete_summary:
        item["delete"] = {"summary": delete_summary, "parameters": param,
                          "responses": {**_ok(), **_errors((401, 404))}}
    return item


def _drop_null(schema: dict) -> dict:
    """An optional field (`X | None = None`) is documented as X: leaving it out is how a client says
    "unset", and the schema reads like the API's own (`temperature: {maximum: 2}`)."""
    for name, prop in schema.get("properties", {}).items():
        options = prop.get("anyOf")
        if options and {"type": "null"} in options and len(options) == 2:
            (kept,) = [o for o in options if o != {"type": "null"}]
            schema["properties"][name] = {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")}, **kept}
    return schema


def _schemas() -> dict:
    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS.values()],
                                ref_template="#/components/schemas/{model}")
    schemas = {name: _drop_null(s) for name, s in top["$defs"].items()}
    schemas["TokenizeRequest"] = {"oneOf": [{"$ref": "#/components/schemas/TokenizePromptRequest"},
                                            {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    schemas["ErrorResponse"] = _ERROR
    schemas["AnthropicError"] = _ANTHROPIC_ERROR
    return schemas


DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "Duet", "version": "1",
             "description": "OpenAI-compatible (and Anthropic Messages) completions over a paged engine and a "
                            "prefix-cache engine."},
    "paths": {
        "/v1/chat/completions": _post("Create a chat completion", "ChatCompletionRequest", stream=True),
        "/v1/completions": _post("Create a completion (one prompt or a batch)", "CompletionRequest", stream=True),
        "/v1/responses": _post("Create a response (the Responses API)", "ResponsesRequest", stream=True),
        "/v1/responses/{response_id}": _by_id("response_id", "A stored response", "Delete a stored response"),
        "/v1/messages": _post("Create a message (the Anthropic Messages API)", "MessagesRequest", stream=True,
                              error_schema="AnthropicError"),
        "/v1/messages/count_tokens": _post("Count a message request's input tokens", "CountTokensRequest",
                                           (400, 401, 404, 413), error_schema="AnthropicError"),
        "/v1/models": _get("List the served models", 401),
        "/v1/models/{model_id}": _by_id("model_id", "One served model (404 for an unknown id)"),
        "/tokenize": _post("Token ids of a prompt or of a rendered chat (vLLM's shape)", "TokenizeRequest",
                           (400, 404, 413)),
        "/detokenize": _post("The text of token ids (vLLM's shape)", "DetokenizeRequest", (400, 404, 413)),
        "/version": _get("The server's version"),
        "/health": _get("Liveness"),
        "/ready": _get("Readiness: every model has a healthy worker", 503),
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        "schemas": _schemas(),
    },
    "security": [{}, {"bearer": []}, {"x-api-key": []}],
}


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(DOCUMENT)
