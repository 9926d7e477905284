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

What Duet cannot do is refused with a 400 naming the field (other tool types, non-text parts,
reasoning items, `truncation: auto`, `parallel_tool_calls: false`), never accepted and ignored.
`conversation` is the conversation without the instructions: what a later request continues.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import InvalidRequest

ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True)
class ResponsesRequest:
    chat_body: dict  # what gateway.protocol.parse_chat validates and the generation path serves
    conversation: list[dict]  # chat messages of the whole conversation so far, instructions left out
    store: bool
    stream: bool
    echo: dict  # the request's options as a Response object repeats them


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}: only text content parts (input_text, output_text) are supported",
                                     "input")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"{where}.content must be a string or a list of text parts", "input")


def _called(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def input_messages(raw: object, earlier: list[dict]) -> list[dict]:
    """The chat messages of `input`; a function_call_output must answer a call made before it (in this
    input or in the conversation it continues)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    called = _called(earlier)
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}", "input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(args, str):
                raise InvalidRequest(f"{where}: a function_call needs call_id, name and arguments (a JSON string)",
                                     "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # calls made together stay one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            called.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise InvalidRequest(f"{where}: function_call_output for call_id {call_id!r}, which answers no "
                                     "earlier function_call", "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), where)})
        else:
            raise InvalidRequest(f"{where}: item type {kind!r} is not supported (message, function_call and "
                                 "function_call_output are)", "input")
    return out


def _tools(body: dict) -> tuple[list | None, object]:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", "tools")
    tools = []
    for i, t in enumerate(raw or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"tools[{i}]: tool type {kind!r} is not supported (only 'function' is)", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                 "'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return (tools if raw is not None else None), choice


def _response_format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if isinstance(text, dict):
            return None
        raise InvalidRequest("'text' must be an object with a 'format'", "text")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format json_schema needs 'schema' (an object)", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}
    raise InvalidRequest("text.format.type must be 'text', 'json_object' or 'json_schema'", "text")


def _refuse_unsupported(body: dict) -> None:
    if body.get("parallel_tool_calls") is False:
        raise InvalidRequest("'parallel_tool_calls': false is not supported (the model may call several tools)",
                             "parallel_tool_calls")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidRequest("'truncation' other than 'disabled' is not supported: a conversation longer than "
                             "the context is refused", "truncation")
    if body.get("reasoning") is not None:
        raise InvalidRequest("'reasoning' is not supported by the models this server runs", "reasoning")
    if body.get("include"):
        raise InvalidRequest("'include' is not supported", "include")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise InvalidRequest("'store' must be a boolean", "store")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in meta.items())):
        raise InvalidRequest("'metadata' must be an object of at most 16 string values", "metadata")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string", "instructions")


def parse_responses(body: object, previous: dict | None) -> ResponsesRequest:
    """Validate and map (see the module doc); `previous` is the stored document of previous_response_id."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _refuse_unsupported(body)
    earlier = list(previous["conversation"]) if previous else []
    conversation = earlier + input_messages(body.get("input"), earlier)
    instructions = body.get("instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    tools, choice = _tools(body)
    chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
            "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "user": body.get("user"), "tools": tools, "tool_choice": choice,
            "response_format": _response_format(body)}
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "previous_response_id": body.get("previous_response_id"), "user": body.get("user"),
            "parallel_tool_calls": True, "truncation": "disabled"}
    return ResponsesRequest({k: v for k, v in chat.items() if v is not None}, conversation,
                            body.get("store") is not False, body.get("stream") is True, echo)
