"""OpenAI tool calling, the request side: validate `tools` / `tool_choice` and the tool turns of a
chat, render them into the prompt, and say what the engine must be held to.

    parse_tools(tools, choice, messages) -> ToolRequest | None  (400 on a choice or call id that does not fit)
    render_chat(messages, ...) -> (messages, tools)    what the chat template gets
    ToolRequest.constraint()   -> a JSON schema for `required` / a named function, else None

Rendering: a chat template that takes `tools` (it mentions them) renders them itself. Otherwise the
tools go into a default system block in the Hermes format most open models are trained on, assistant
tool calls become `<tool_call>{"name": ..., "arguments": ...}</tool_call>` text and tool results
`<tool_response>...</tool_response>` turns (docs/operations.md shows the block).

Enforcement: `required` holds the output to one JSON object `{"name": <a tool>, "arguments": <its
schema>}`; a named function holds it to that function's argument schema. Both compile with xgrammar
in engine_prefix, so the arguments always parse and validate; `auto` parses whatever the model says
(gateway/serving/tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.errors import InvalidRequest

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}

SYSTEM_BLOCK = (
    "You may call one or more functions to help with the user's request. The functions are described "
    "by JSON schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]  # validated {"type": "function", "function": {...}} entries
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the forced function when choice == "function"

    @property
    def active(self) -> bool:
        """The model may (or must) call a tool, so its output is parsed for calls."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or _EMPTY_PARAMETERS

    def constraint(self) -> str | None:
        """The JSON schema the engine must hold the output to, or None (auto / none)."""
        if self.choice == "function":
            return json.dumps(self.parameters(self.function))
        if self.choice == "required":
            options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         "arguments": self.parameters(t["function"]["name"])},
                        "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
            return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})
        return None


def _choice(raw: object, names: list[str]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if isinstance(raw, str):  # "none" | "auto" | "required" (the model checked)
        if raw != "none" and not names:
            raise InvalidRequest(f"tool_choice: '{raw}' needs a non-empty 'tools' list", "tool_choice")
        return raw, None
    name = raw["function"]["name"]
    if name not in names:
        raise InvalidRequest(f"tool_choice: names function {name!r}, which is not in 'tools'", "tool_choice")
    return "function", name


def _check_tool_turns(messages: list[dict]) -> None:
    """Tool calls are an assistant's, and every tool message answers a call made before it."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant":
                raise InvalidRequest(f"messages[{i}].tool_calls: only an assistant message makes tool calls",
                                     "messages")
            called.update(c["id"] for c in calls)
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in called:
                raise InvalidRequest(f"messages[{i}] (role 'tool') has tool_call_id {call_id!r}, which answers no "
                                     "earlier assistant tool call", "messages")


def parse_tools(tools: list[dict] | None, tool_choice: object, messages: list[dict]) -> ToolRequest | None:
    """`tools` and `tool_choice` as the validated model dumped them (gateway/api/request_models.py checked each
    tool's shape); here the rules between them and the messages."""
    _check_tool_turns(messages)
    if tools is None and tool_choice in (None, "none"):
        return None
    tools = [{"type": "function", "function": t["function"]} for t in tools or []]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique", "tools")
    choice, function = _choice(tool_choice, names)
    return ToolRequest(tuple(tools), choice, function)


def format_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def render_chat(messages: list[dict], tools: ToolRequest | None, template_takes_tools: bool
                ) -> tuple[list[dict], list[dict] | None]:
    """The messages and `tools` argument for the chat template (see the module doc)."""
    if template_takes_tools:
        return messages, list(tools.tools) if tools and tools.tools else None
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(format_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m.get("content") else calls
            m = {"role": "assistant", "content": text}
        elif m.get("role") == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        elif m.get("content") is None:
            m = {**m, "content": ""}
        out.append(m)
    if tools is not None and tools.active:
        block = SYSTEM_BLOCK.format(tools="\n".join(json.dumps(t) for t in tools.tools))
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None
