"""OpenAI tool calling, the response side: one choice's text deltas -> content and tool-call deltas.

`ToolCallParser(mode, function, choice)` is fed one choice's text as it streams and returns the run's
events (gateway/serving/events.py): `Content`, `CallStart` and `Arguments`; the argument pieces of a
call concatenate to its `arguments` string. `parse_whole` feeds it a whole text at once: both forms agree.

    mode "function"  the output is the forced function's arguments (held to its schema)
    mode "required"  the output is one {"name": ..., "arguments": ...} object (held to the schema)
    mode "auto"      free text; each <tool_call>{"name": ..., "arguments": ...}</tool_call> (the
                     Hermes format) is a call, the text around them is content

Argument text streams as it arrives, except a trailing run of whitespace and `}` (it may be the end
of the enclosing object rather than of the arguments) and, in auto mode, anything that could be the
start of a tag. Text inside a tag that never takes the call shape comes back as content, tags and all.
"""

from __future__ import annotations

import json
import re
import uuid

from gateway.serving.events import Arguments, CallStart, Content, ToolCall, answer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HOLD = " \t\r\n}"


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _ObjectCall:
    """One `{"name": N, "arguments": A}` object arriving in pieces."""

    def __init__(self, index: int, choice: int) -> None:
        self.index, self.choice = index, choice
        self.text = ""
        self.args_at: int | None = None
        self.sent = 0  # characters of the arguments already streamed

    @property
    def started(self) -> bool:
        return self.args_at is not None

    def feed(self, text: str, events: list) -> None:
        self.text += text
        if self.args_at is None:
            m = _HEAD.match(self.text)
            if m is None or m.end() == len(self.text):  # wait for the value's first character
                return
            self.args_at = m.end()
            events.append(CallStart(self.index, _call_id(), json.loads(f'"{m.group(1)}"'), self.choice))
        body = self.text[self.args_at:]
        safe = len(body.rstrip(_HOLD))
        if safe > self.sent:
            events.append(Arguments(self.index, body[self.sent:safe], self.choice))
            self.sent = safe

    def close(self, events: list) -> None:
        """The object is complete: send the rest of the arguments (exactly the JSON value's text)."""
        body = self.text[self.args_at:]
        try:
            _, end = json.JSONDecoder().raw_decode(body.lstrip())
            end += len(body) - len(body.lstrip())
        except json.JSONDecodeError:  # not valid JSON (auto mode, a cut-off output): pass it on as it is,
            end = len(body.rstrip())  # less the enclosing object's closing brace when there is one
            if body[:end].count("}") > body[:end].count("{"):
                end = body.rindex("}", 0, end)
        if end > self.sent:
            events.append(Arguments(self.index, body[self.sent:end], self.choice))
            self.sent = end


class ToolCallParser:
    def __init__(self, mode: str, function: str | None = None, choice: int = 0) -> None:
        assert mode in ("auto", "required", "function"), mode
        self.mode = mode
        self.function = function
        self.choice = choice  # the choice whose text this is (every event names it)
        self.calls = 0
        self._pending = ""  # auto: text held back (a possible tag start)
        self._call: _ObjectCall | None = None  # the call being read (auto: inside a tag)
        self._started = False

    def feed(self, text: str) -> list:
        events: list = []
        if self.mode == "function":
            if not self._started:
                self._started = True
                events.append(CallStart(0, _call_id(), self.function, self.choice))
                self.calls = 1
            if text:
                events.append(Arguments(0, text, self.choice))
        elif self.mode == "required":
            if self._call is None:
                self._call = _ObjectCall(0, self.choice)
            self._call.feed(text, events)
            self.calls = int(self._call.started)
        else:
            self._pending += text
            self._scan(events)
        return events

    def _scan(self, events: list) -> None:
        while True:
            if self._call is None:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._pending, OPEN)
                    self._emit_content(self._pending[: len(self._pending) - keep], events)
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                self._emit_content(self._pending[:at], events)
                self._pending = self._pending[at + len(OPEN):]
                self._call = _ObjectCall(self.calls, self.choice)
            at = self._pending.find(CLOSE)
            inside = self._pending if at < 0 else self._pending[:at]
            if at < 0:  # hold back what may be the start of the closing tag
                keep = _partial_suffix(inside, CLOSE)
                inside, self._pending = inside[: len(inside) - keep], inside[len(inside) - keep:]
            else:
                self._pending = self._pending[at + len(CLOSE):]
            self._call.feed(inside, events)
            if at < 0:
                return
            self._end_call(events)

    def _end_call(self, events: list) -> None:
        call, self._call = self._call, None
        if call.started:
            call.close(events)
            self.calls += 1
        else:  # never took the call shape: it was text after all
            self._emit_content(OPEN + call.text + CLOSE, events)

    def finish(self) -> list:
        events: list = []
        if self.mode == "required" and self._call is not None and self._call.started:
            self._call.close(events)
        elif self.mode == "auto":
            if self._call is not None:
                self._call.feed(self._pending, events)
                self._pending = ""
                call, self._call = self._call, None
                if call.started:
                    call.close(events)
                    self.calls += 1
                else:
                    self._emit_content(OPEN + call.text, events)
            self._emit_content(self._pending, events)
            self._pending = ""
        return events

    def _emit_content(self, text: str, events: list) -> None:
        if text:
            events.append(Content(text, self.choice))


def parse_whole(text: str, mode: str, function: str | None = None) -> tuple[str | None, list[dict]]:
    """The chat message's content (None when only calls were made) and its `tool_calls` list."""
    parser = ToolCallParser(mode, function)
    whole = answer(parser.feed(text) + parser.finish())
    return (whole.text or None) if whole.calls else whole.text, openai_calls(whole.calls)


def openai_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """A chat message's `tool_calls`."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
