"""The OpenAPI 3.1 document of the public API, served at `GET /openapi.json`.

Every schema in it is generated from the pydantic models: the request bodies that validate
(gateway/api/request_models.py, responses_input.py, messages_input.py) and the answers and error shapes
(gateway/api/answer_models.py). This module only lists the operations: path, method, the request and
answer models, and the error statuses (OpenAI's error shape, or Anthropic's on /v1/messages*). A
client generator or the fuzzer (tests/gateway/test_fuzz_openapi.py drives schemathesis from it)
sees what the gateway accepts. The admin API is operator-only and left out.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.api import answer_models as out
from gateway.api.messages_input import CountTokensRequest, MessagesRequest
from gateway.api.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
)
from gateway.api.responses_input import ResponsesRequest

_REASONS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or id",
            413: "body too large", 429: "rate limited (Retry-After)", 500: "gateway bug",
            502: "every worker failed", 503: "no worker can serve it, or the state store is down"}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 502, 503)


class Operation(NamedTuple):
    method: str
    path: str
    summary: str
    answer: type[BaseModel]
    body: tuple[type[BaseModel], ...] = ()  # several: one of them (oneOf)
    errors: tuple[int, ...] = (401,)
    stream: bool = False  # also answers server-sent events
    path_param: str | None = None

    @property
    def error_model(self) -> type[BaseModel]:
        return out.AnthropicError if self.path.startswith("/v1/messages") else out.ErrorResponse


OPERATIONS = (
    Operation("post", "/v1/chat/completions", "Create a chat completion", out.ChatCompletion,
              (ChatCompletionRequest,), GENERATION_ERRORS, stream=True),
    Operation("post", "/v1/completions", "Create a completion (one prompt or a batch)", out.Completion,
              (CompletionRequest,), GENERATION_ERRORS, stream=True),
    Operation("post", "/v1/responses", "Create a response (the Responses API)", out.Response,
              (ResponsesRequest,), GENERATION_ERRORS, stream=True),
    Operation("get", "/v1/responses/{response_id}", "A stored response", out.Response, errors=(401, 404, 503),
              path_param="response_id"),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response", out.DeletedResponse,
              errors=(401, 404, 503), path_param="response_id"),
    Operation("post", "/v1/messages", "Create a message (the Anthropic Messages API)", out.Message,
              (MessagesRequest,), GENERATION_ERRORS, stream=True),
    Operation("post", "/v1/messages/count_tokens", "Count a message request's input tokens", out.TokenCount,
              (CountTokensRequest,), (400, 401, 404, 413)),
    Operation("get", "/v1/models", "List the served models", out.ModelList),
    Operation("get", "/v1/models/{model_id}", "One served model (404 for an unknown id)", out.ModelCard,
              errors=(401, 404), path_param="model_id"),
    Operation("post", "/tokenize", "Token ids of a prompt or of a rendered chat (vLLM's shape)", out.Tokens,
              (TokenizePromptRequest, TokenizeChatRequest), (400, 404, 413)),
    Operation("post", "/detokenize", "The text of token ids (vLLM's shape)", out.Detokenized,
              (DetokenizeRequest,), (400, 404, 413)),
    Operation("get", "/version", "The server's version", out.Version, errors=()),
    Operation("get", "/health", "Liveness", out.Health, errors=()),
    Operation("get", "/ready", "Readiness: every model has a healthy worker", out.Readiness, errors=(503,)),
)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(op: Operation) -> dict:
    content = {"application/json": {"schema": _ref(op.answer)}}
    if op.stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    responses = {"200": {"description": "the answer" + (", or server-sent events when stream" if op.stream else ""),
                         "content": content}}
    for status in op.errors:
        responses[str(status)] = {"description": _REASONS[status],
                                  "content": {"application/json": {"schema": _ref(op.error_model)}}}
    item: dict = {"summary": op.summary, "responses": responses}
    if op.body:
        schema = _ref(op.body[0]) if len(op.body) == 1 else {"oneOf": [_ref(m) for m in op.body]}
        item["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if op.path_param:
        item["parameters"] = [{"name": op.path_param, "in": "path", "required": True, "schema": {"type": "string"}}]
    return item


def _drop_null(schema: dict) -> dict:
    """An optional field (`X | None = None`) is documented as X: leaving it out is how a client says
    "unset", and the schema reads like the API's own (`temperature: {maximum: 2}`)."""
    for name, prop in schema.get("properties", {}).items():
        options = prop.get("anyOf")
        if options and {"type": "null"} in options and len(options) == 2 and name not in schema.get("required", ()):
            (kept,) = [o for o in options if o != {"type": "null"}]
            schema["properties"][name] = {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")}, **kept}
    return schema


def _defs(models, mode: str) -> dict:
    _, top = models_json_schema([(m, mode) for m in sorted(models, key=lambda m: m.__name__)],
                                ref_template="#/components/schemas/{model}")
    return top["$defs"]


def _schemas() -> dict:
    # request models are documented without their nulls (see _drop_null); answers say null where they write it
    requests = {name: _drop_null(s) for name, s in _defs({m for op in OPERATIONS for m in op.body},
                                                         "validation").items()}
    answers = _defs({op.answer for op in OPERATIONS} | {out.ErrorResponse, out.AnthropicError}, "serialization")
    assert not set(requests) & set(answers), "a request and an answer model share a name"
    return {**requests, **answers}


def _document() -> dict:
    paths: dict = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Duet", "version": "1",
                 "description": "OpenAI-compatible (and Anthropic Messages) completions over a paged engine and a "
                                "prefix-cache engine."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": _schemas(),
        },
        "security": [{}, {"bearer": []}, {"x-api-key": []}],
    }


DOCUMENT = _document()


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(DOCUMENT)
