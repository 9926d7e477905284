"""The OpenAPI 3.1 document of the public API, served at `GET /openapi.json`.

Written by hand from gateway/protocol.py's rules (the same ranges, the same required fields), so a
client generator or a fuzzer (tests/gateway/test_fuzz_openapi.py drives schemathesis from it) sees
what the gateway accepts. Every error status answers the `ErrorResponse` shape of gateway/errors.py.
The admin API is operator-only and left out.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.protocol import CHAT_ROLES, MAX_BATCH_PROMPTS, MAX_N, MAX_STOP_STRINGS, MAX_TOKEN_ID

_INT31 = 1 << 31


def _num(lo: float, hi: float, integer: bool = False) -> dict:
    return {"type": "integer" if integer else "number", "minimum": lo, "maximum": hi}


_SAMPLING = {
    "max_tokens": _num(1, _INT31, integer=True),
    "temperature": _num(0, 2),
    "top_p": _num(1e-9, 1),
    "top_k": _num(0, 1 << 20, integer=True),
    "min_p": _num(0, 1),
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0.001, 10),
    "seed": _num(-(1 << 63), (1 << 64) - 1, integer=True),
    "n": _num(1, MAX_N, integer=True),
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS}]},
    "stop_token_ids": {"type": "array", "items": _num(0, MAX_TOKEN_ID - 1, integer=True)},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": _num(0, _INT31, integer=True),
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"],
                            "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}}}},
    ]},
}

_TOOL_CALL = {
    "type": "object", "required": ["id", "type", "function"],
    "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name", "arguments"],
                                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}},
}

_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": sorted(CHAT_ROLES)},
        "content": {"oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
            {"type": "null"},  # an assistant turn that only made tool calls
        ]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
        "tool_call_id": {"type": "string"},
    },
}

_TOOL = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                                               "description": {"type": "string"},
                                               "parameters": {"type": "object"}}}},
}

_TOOL_CHOICE = {"oneOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
]}

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}


def _error_responses(*statuses: int) -> dict:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    reasons = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
               413: "body too large", 429: "rate limited (Retry-After)", 500: "gateway bug",
               502: "every worker failed", 503: "no worker can serve it"}
    return {str(s): {"description": reasons[s], **ref} for s in statuses}


def _generation(summary: str, request_schema: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request_schema}"}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or SSE chunks ending with `data: [DONE]` when stream",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_error_responses(400, 401, 404, 413, 429, 500, 502, 503),
        },
    }}


def _post(summary: str, request_schema: str, *statuses: int) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request_schema}"}}}},
        "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                      **_error_responses(*statuses)}}}


def _get(summary: str, *statuses: int) -> dict:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
        **_error_responses(*statuses)}}}


DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "Duet", "version": "1",
             "description": "OpenAI-compatible completions over a paged engine and a prefix-cache engine."},
    "paths": {
        "/v1/chat/completions": _generation("Create a chat completion", "ChatCompletionRequest"),
        "/v1/completions": _generation("Create a completion", "CompletionRequest"),
        "/v1/models": _get("List the served models", 401),
        "/v1/models/{model_id}": {"get": {
            "summary": "One served model (404 for an unknown id)",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {
                "type": "object"}}}}, **_error_responses(401, 404)}}},
        "/tokenize": _post("Token ids of a prompt or of a rendered chat (vLLM's shape)", "TokenizeRequest",
                           400, 404, 413),
        "/detokenize": _post("The text of token ids (vLLM's shape)", "DetokenizeRequest", 400, 404, 413),
        "/version": _get("The server's version"),
        "/health": _get("Liveness"),
        "/ready": _get("Readiness: every model has a healthy worker", 503),
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "ChatCompletionRequest": {
                "type": "object", "required": ["model", "messages"],
                "properties": {
                    "model": {"type": "string", "minLength": 1},
                    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                    "max_completion_tokens": _num(1, _INT31, integer=True),
                    "logprobs": {"type": "boolean"},
                    "top_logprobs": _num(0, 20, integer=True),
                    "tools": {"type": "array", "items": _TOOL},
                    "tool_choice": _TOOL_CHOICE,
                    **_SAMPLING,
                },
            },
            "CompletionRequest": {
                "type": "object", "required": ["model", "prompt"],
                "properties": {
                    "model": {"type": "string", "minLength": 1},
                    "prompt": {"oneOf": [
                        {"type": "string", "minLength": 1},
                        {"type": "array", "minItems": 1, "items": _num(0, MAX_TOKEN_ID - 1, integer=True)},
                        {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS,
                         "items": {"type": "string", "minLength": 1}},
                        {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS,
                         "items": {"type": "array", "minItems": 1,
                                   "items": _num(0, MAX_TOKEN_ID - 1, integer=True)}},
                    ]},
                    "echo": {"type": "boolean"},
                    "logprobs": _num(0, 20, integer=True),
                    **_SAMPLING,
                },
            },
            "TokenizeRequest": {"oneOf": [
                {"type": "object", "required": ["prompt"], "properties": {
                    "model": {"type": "string"}, "prompt": {"type": "string"},
                    "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}},
                {"type": "object", "required": ["messages"], "properties": {
                    "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                    "add_generation_prompt": {"type": "boolean"}, "continue_final_message": {"type": "boolean"},
                    "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"},
                    "tools": {"type": "array", "items": _TOOL}}},
            ]},
            "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
                "model": {"type": "string"}, "tokens": {"type": "array", "items": _num(0, MAX_TOKEN_ID - 1,
                                                                                      integer=True)}}},
            "ErrorResponse": _ERROR,
        },
    },
    "security": [{}, {"bearer": []}],
}


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(DOCUMENT)
