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
read from it like every other field. What Duet cannot do is a 400 naming the field (image and document
blocks, `thinking`, server tools), never accepted and ignored.
"""

from __future__ import annotations

import json

from gateway.errors import InvalidRequest

MAX_STOP_SEQUENCES = 16


def _text_blocks(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for block in value:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise InvalidRequest(f"{where}: only text blocks are supported here", "messages")
            parts.append(block["text"])
        return "".join(parts)
    raise InvalidRequest(f"{where} must be a string or a list of text blocks", "messages")


def _message(m: object, i: int, called: set[str]) -> list[dict]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role must be 'user' or 'assistant'", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content blocks", "messages")
    text: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(
                    block.get("input"), dict):
                raise InvalidRequest(f"{at}: a tool_use block needs an id, a name and an input object", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            called.add(block["id"])
        elif kind == "tool_result" and role == "user":
            use_id = block.get("tool_use_id")
            if not isinstance(use_id, str) or use_id not in called:
                raise InvalidRequest(f"{at}: tool_result for tool_use_id {use_id!r}, which answers no earlier "
                                     "tool_use block", "messages")
            body = block.get("content", "")
            output = _text_blocks(body, at)
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": use_id, "content": output})
        else:
            raise InvalidRequest(f"{at}: block type {kind!r} is not supported in a {role} message (text, "
                                 "tool_use from the assistant, tool_result from the user are)", "messages")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _tools(body: dict) -> tuple[list | None, object]:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", "tools")
    tools = []
    for i, t in enumerate(raw or []):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or "input_schema" not in t:
            raise InvalidRequest(f"tools[{i}]: only client tools {{name, description, input_schema}} are supported",
                                 "tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None:
        return (tools if raw is not None else None), None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
        raise InvalidRequest("tool_choice.disable_parallel_tool_use is not supported", "tool_choice")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise InvalidRequest("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    return (tools if raw is not None else None), mapped


def parse_messages(body: object) -> dict:
    """The chat body of an Anthropic Messages request (see the module doc)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise InvalidRequest("'max_tokens' is required", "max_tokens")
    if body.get("thinking") is not None:
        raise InvalidRequest("'thinking' is not supported by the models this server runs", "thinking")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    called: set[str] = set()
    chat = [t for i, m in enumerate(messages) for t in _message(m, i, called)]
    system = body.get("system")
    if system is not None:
        chat.insert(0, {"role": "system", "content": _text_blocks(system, "system")})
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
                              or not all(isinstance(s, str) and s for s in stops)):
        raise InvalidRequest(f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings",
                             "stop_sequences")
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise InvalidRequest("'metadata' must be an object", "metadata")
    user = (meta or {}).get("user_id")
    tools, choice = _tools(body)
    out = {"model": body.get("model"), "messages": chat, "max_tokens": body["max_tokens"], "stop": stops,
           "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
           "stream": body.get("stream"), "user": user, "tools": tools, "tool_choice": choice}
    return {k: v for k, v in out.items() if v is not None}
