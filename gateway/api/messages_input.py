"""The Anthropic Messages API's request (`POST /v1/messages`) -> the chat request Duet serves.

    system (a string or text blocks)          -> a system message first
    messages[].content: a string or blocks    -> chat messages:
      text blocks                             -> the message's text
      tool_use {id, name, input} (assistant)  -> the assistant message's tool_calls (input as JSON)
      tool_result {tool_use_id, content}      -> a tool message answering that call (it must exist)
    tools [{name, description, input_schema}] -> chat function tools
    tool_choice {type: auto | any | tool | none, name}  -> auto | required | the named function | none
    max_tokens (required), stop_sequences, temperature, top_p, top_k, metadata.user_id, stream

Anthropic's SDK sends temperature / top_p / top_k in the body (through extra_body in 2.15): they are
read from it like every other field. The request models below are the one description of the body (validated through
gateway/api/validation.py, and in /openapi.json). What Duet cannot do is a 400 naming the field (image
and document blocks, `thinking`, server tools, `disable_parallel_tool_use`), never accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.api.request_models import (
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    MaxTokens,
    Name,
    Schema,
    Strict,
    Temperature,
    Text,
    TopK,
    TopP,
)
from gateway.api.validation import refuse_unsupported, validate
from gateway.errors import InvalidRequest


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None  # true: the output is shown to the model as "Error: ..."


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Strict):
    type: Literal["custom"] | None = None  # client tools only: server tools (web search...) are refused
    name: Name
    description: str | None = None
    input_schema: Schema


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: Literal[False] | None = None  # true is not done: the model may call several


class MessagesMetadata(Strict):
    user_id: str | None = None


class CountTokensRequest(Strict):
    model: Text
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool | None = None
    metadata: MessagesMetadata | None = None


REFUSED = {"thinking": "the models this server runs do not think in a separate channel"}


def _text(value: str | list[TextBlock]) -> str:
    return value if isinstance(value, str) else "".join(b.text for b in value)


def _message(m: AnthropicMessage, i: int, called: set[str]) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(m.content):
        at = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock) and m.role == "assistant":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            called.add(block.id)
        elif isinstance(block, ToolResultBlock) and m.role == "user":
            if block.tool_use_id not in called:
                raise InvalidRequest(f"{at}: tool_result for tool_use_id {block.tool_use_id!r}, which answers no "
                                     "earlier tool_use block", "messages")
            output = _text(block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {output}" if block.is_error else output})
        else:
            raise InvalidRequest(f"{at}: a {block.type} block comes from the "
                                 f"{'assistant' if block.type == 'tool_use' else 'user'}, not the {m.role}",
                                 "messages")
    if m.role == "assistant":
        return [{"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _tools(req: CountTokensRequest) -> tuple[list | None, object]:
    tools = None if req.tools is None else [
        {"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                          **({"description": t.description} if t.description is not None else {})}}
        for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return tools, None
    if choice.type == "tool":
        return tools, {"type": "function", "function": {"name": choice.name}}
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def validate_messages(body: object, model: type[CountTokensRequest] = MessagesRequest) -> CountTokensRequest:
    if isinstance(body, dict):
        refuse_unsupported(body, REFUSED)
    return validate(model, body)


def parse_messages(body: object, model: type[CountTokensRequest] = MessagesRequest) -> dict:
    """The chat body of an Anthropic Messages (or count_tokens) request (see the module doc)."""
    req = validate_messages(body, model)
    called: set[str] = set()
    chat = [t for i, m in enumerate(req.messages) for t in _message(m, i, called)]
    if req.system is not None:
        chat.insert(0, {"role": "system", "content": _text(req.system)})
    tools, choice = _tools(req)
    out = {"model": req.model, "messages": chat, "tools": tools, "tool_choice": choice}
    if isinstance(req, MessagesRequest):
        out.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                   top_p=req.top_p, top_k=req.top_k, stream=req.stream,
                   user=req.metadata.user_id if req.metadata else None)
    return {k: v for k, v in out.items() if v is not None}
