"""The Responses API's request (`POST /v1/responses`) -> the chat request Duet serves.

A Responses request is a conversation as a list of items plus options; it maps onto a chat body:

    input: "text"                      -> one user message
    input items {role, content}        -> messages (content: a string or input_text / output_text parts)
    {type: function_call, call_id, name, arguments}   -> an assistant message's tool_calls
    {type: function_call_output, call_id, output}     -> a tool message answering that call
    instructions                       -> a system message first (this request only: not carried on)
    previous_response_id               -> the stored conversation of that response comes first
    tools [{type: function, name, description, parameters}], tool_choice  -> chat tools / tool_choice
    text.format {type: text | json_object | json_schema}                  -> response_format
    max_output_tokens, temperature, top_p, user                           -> the chat fields

The request model below is the one description of the body (validated through gateway/api/validation.py,
and in /openapi.json). What Duet cannot do is refused with a 400 naming the field (other tool types,
non-text parts, reasoning items, `truncation: auto`, `parallel_tool_calls: false`, `reasoning`,
`include`), never accepted and ignored.
`conversation` is the conversation without the instructions: what a later request continues.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from gateway.api.request_models import (
    MAX_TOOLS,
    FunctionDef,
    MaxTokens,
    NamedFunction,
    ResponseFormatPlain,
    Schema,
    Strict,
    Temperature,
    Text,
    ToolChoiceMode,
    TopP,
)
from gateway.api.validation import refuse_unsupported, validate
from gateway.errors import InvalidRequest


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


Content = str | list[InputText]


class InputMessage(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: str  # a JSON string


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class ResponsesTool(FunctionDef):  # a chat tool's function, flattened beside its type
    type: Literal["function"]


class ResponsesNamedChoice(NamedFunction):
    type: Literal["function"]


class TextFormatSchema(Strict):
    type: Literal["json_schema"]
    name: str | None = None
    schema_: Annotated[Schema, Field(alias="schema")]


class TextOptions(Strict):
    format: Annotated[ResponseFormatPlain | TextFormatSchema, Field(discriminator="type")] | None = None


_ITEMS = {"message": "InputMessage", "function_call": "FunctionCallItem",
          "function_call_output": "FunctionCallOutputItem"}


def _known_item(item: object) -> object:
    if isinstance(item, dict) and item.get("type", "message") not in _ITEMS:
        raise PydanticCustomError("item_type", "item type {kind} is not supported (message, function_call and "
                                  "function_call_output are)", {"kind": json.dumps(item.get("type"))})
    return item


def _item_model(item: object) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None) or "message"
    return _ITEMS.get(kind)


# an item without a type is a message
Item = Annotated[Annotated[InputMessage, Tag("InputMessage")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
                 | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
                 Discriminator(_item_model), BeforeValidator(_known_item)]


class ResponsesRequest(Strict):
    model: Text
    input: Text | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceMode | ResponsesNamedChoice | None = None
    text: TextOptions | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    parallel_tool_calls: Literal[True] | None = None  # false is not done: the model may call several tools
    truncation: Literal["disabled"] | None = None  # a conversation longer than the context is refused


REFUSED = {"reasoning": "the models this server runs do not reason in a separate channel",
           "include": "no extra output fields are kept"}


@dataclass(frozen=True)
class Responses:
    """A validated Responses request, mapped (see the module doc)."""

    chat_body: dict  # what gateway.api.protocol.parse_chat turns into the ApiRequest the generation path serves
    conversation: list[dict]  # chat messages of the whole conversation so far, instructions left out
    store: bool
    stream: bool
    echo: dict  # the request's options as a Response object repeats them


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _called(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def input_messages(raw: str | list, earlier: list[dict]) -> list[dict]:
    """The chat messages of a validated `input`; a function_call_output must answer a call made before it
    (in this input or in the conversation it continues)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict] = []
    called = _called(earlier)
    for i, item in enumerate(raw):
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # calls made together stay one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            called.add(item.call_id)
        else:
            if item.call_id not in called:
                raise InvalidRequest(f"input[{i}]: function_call_output for call_id {item.call_id!r}, which answers "
                                     "no earlier function_call", "input")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def _tools(req: ResponsesRequest) -> tuple[list | None, object]:
    tools = None if req.tools is None else [
        {"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                      exclude_none=True)} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, ResponsesNamedChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    return tools, choice


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text else None
    if fmt is None:
        return None
    if isinstance(fmt, ResponseFormatPlain):
        return {"type": fmt.type}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}


def validate_responses(body: object) -> ResponsesRequest:
    if isinstance(body, dict):
        refuse_unsupported(body, REFUSED)
    return validate(ResponsesRequest, body)


def parse_responses(body: object, previous: dict | None) -> Responses:
    """Validate and map (see the module doc); `previous` is the stored document of previous_response_id."""
    return to_chat(validate_responses(body), previous, body)


def to_chat(req: ResponsesRequest, previous: dict | None, body: dict) -> Responses:
    """Map a validated request (`body` is what it was validated from: the options a Response repeats)."""
    earlier = list(previous["conversation"]) if previous else []
    conversation = earlier + input_messages(req.input, earlier)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools, choice = _tools(req)
    chat = {"model": req.model, "messages": messages, "stream": req.stream, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user, "tools": tools,
            "tool_choice": choice, "response_format": _response_format(req)}
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": req.metadata or {},
            "previous_response_id": req.previous_response_id, "user": req.user,
            "parallel_tool_calls": True, "truncation": "disabled"}
    return Responses({k: v for k, v in chat.items() if v is not None}, conversation,
                     req.store is not False, bool(req.stream), echo)
