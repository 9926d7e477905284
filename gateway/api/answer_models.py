"""What the public API answers, as pydantic models: the non-streaming response of each endpoint and
the two error shapes. /openapi.json documents every 200 and error body from these
(gateway/openapi.py), and the fuzz tier validates real answers against them
(tests/gateway/test_fuzz_openapi.py), so the document cannot drift from what the builders
(gateway/serving/chat_chunks.py, gateway/api/responses.py, messages.py, tokenize.py) write. Streaming answers
are server-sent events of the same objects' chunks (docs/operations.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class _Answer(BaseModel):
    pass


# -- errors (gateway/errors.py writes them) --------------------------------------------------
class ErrorObject(_Answer):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Answer):
    """OpenAI's error shape, on every path but /v1/messages*."""

    error: ErrorObject


class AnthropicErrorObject(_Answer):
    type: str
    message: str


class AnthropicError(_Answer):
    """Anthropic's error shape, on /v1/messages*."""

    type: Literal["error"]
    error: AnthropicErrorObject


# -- chat completions and completions --------------------------------------------------------
class PromptTokensDetails(_Answer):
    cached_tokens: int


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ToolCallOut(_Answer):
    id: str
    type: Literal["function"]
    function: dict[str, str]  # name, arguments (a JSON string)


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked for


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# -- the Responses API -----------------------------------------------------------------------
class OutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class MessageItem(_Answer):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOut(_Answer):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ResponsesUsage(_Answer):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class Response(_Answer):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[MessageItem | FunctionCallOut]
    incomplete_details: dict[str, str] | None
    error: None
    store: bool
    usage: ResponsesUsage | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    metadata: dict[str, str]
    previous_response_id: str | None
    user: str | None
    parallel_tool_calls: bool
    truncation: str


class DeletedResponse(_Answer):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# -- the Anthropic Messages API --------------------------------------------------------------
class TextOut(_Answer):
    type: Literal["text"]
    text: str


class ToolUseOut(_Answer):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(_Answer):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class Message(_Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(_Answer):
    input_tokens: int


# -- models, tokenizer, version, health ------------------------------------------------------
class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(_Answer):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(_Answer):
    prompt: str


class Version(_Answer):
    version: str


class Health(_Answer):
    status: Literal["ok"]


class Readiness(_Answer):
    ready: bool
    healthy_workers: dict[str, int]
