"""Tool calling without a model: request validation (400 with the field named), prompt rendering, the
schema a forced call is held to, and the output parser, streamed piece by piece and whole."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.api.protocol import parse_chat
from gateway.errors import InvalidRequest
from gateway.serving.tool_calls import Arguments, CallStart, Content, ToolCallParser, parse_whole
from gateway.serving.tools import render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], **kw}


def test_default_choice_is_auto_with_tools_and_absent_without():
    assert parse_chat(chat(tools=[WEATHER])).tools.choice == "auto"
    assert parse_chat(chat()).tools is None


@pytest.mark.parametrize("body, field, words", [
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not in 'tools'"),
    (chat(tool_choice="required"), "tool_choice", "needs a non-empty 'tools'"),
    (chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be one of 'none', 'auto' or 'required' or an object"),
    (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools", "tools[0].function.name: must be 1-64 letters"),
    (chat(tools=[{"type": "retrieval"}]), "tools", "tools[0].type: must be 'function', got \"retrieval\""),
    (chat(tools=[WEATHER, WEATHER]), "tools", "unique"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools", "tools[0].function.parameters: must be an object"),
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "20C"}]}, "messages",
     "answers no earlier assistant tool call"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "messages",
     "messages[1].tool_calls[0].type: is required"),
])
def test_bad_tool_requests_are_rejected_naming_the_field(body, field, words):
    with pytest.raises(InvalidRequest) as e:
        parse_chat(body)
    assert e.value.param == field and words in e.value.message


def test_a_tool_turn_answering_a_call_is_accepted():
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    api = parse_chat({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "20C"}]})
    messages, tools = render_chat(list(api.messages), api.tools, template_takes_tools=False)
    assert tools is None
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3] == {"role": "tool", "content": "<tool_response>\n20C\n</tool_response>"}
    # a template that renders tools itself gets them untouched
    messages, tools = render_chat(list(api.messages), api.tools, template_takes_tools=True)
    assert tools == [WEATHER] and messages[1]["tool_calls"] == [call]


def test_tool_choice_none_renders_no_tool_block():
    api = parse_chat(chat(tools=[WEATHER], tool_choice="none"))
    messages, _ = render_chat(list(api.messages), api.tools, template_takes_tools=False)
    assert messages == [{"role": "user", "content": "weather in Paris?"}]
    assert not api.tools.active and api.tools.constraint() is None


def test_constraints_accept_exactly_valid_calls():
    named = json.loads(parse_chat(chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})).tools.constraint())
    jsonschema.validate({"city": "Paris"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "C"}, named)
    required = json.loads(parse_chat(chat(tools=[WEATHER, TIME], tool_choice="required")).tools.constraint())
    jsonschema.validate({"name": "get_time", "arguments": {}}, required)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, required)
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}, {"name": "get_time"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


AUTO_TEXT = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "C"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def _streamed(text: str, mode: str, function: str | None = None, piece: int = 1):
    parser = ToolCallParser(mode, function)
    events = []
    for i in range(0, len(text), piece):
        events += parser.feed(text[i:i + piece])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, Arguments):
            calls[e.index][1] += e.text
    return content, calls, sum(isinstance(e, Arguments) for e in events)


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_auto_mode_streamed_in_any_pieces_gives_the_whole_parse(piece):
    content, calls = parse_whole(AUTO_TEXT, "auto")
    assert content == "Let me look that up."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    s_content, s_calls, arg_pieces = _streamed(AUTO_TEXT, "auto", piece=piece)
    assert s_content.strip() == content
    assert s_calls == {i: [c["function"]["name"], c["function"]["arguments"]] for i, c in enumerate(calls)}
    if piece == 1:
        assert arg_pieces > 10  # the argument string streams, it is not sent at the end in one piece


def test_required_and_named_outputs_parse_to_one_call():
    content, calls = parse_whole('{"name": "get_weather", "arguments": {"city": "Rome"}}', "required")
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert _streamed('{"name": "get_weather", "arguments": {"city": "Rome"}}', "required")[1] == {
        0: ["get_weather", '{"city": "Rome"}']}
    content, calls = parse_whole('{"city": "Rome"}', "function", "get_weather")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


@pytest.mark.parametrize("text", ["plain answer", "a <tool_call>not json</tool_call> b", "ends with <tool_c",
                                  "x <tool_call>{\"name\": 1}"])
def test_text_that_is_not_a_call_stays_content(text):
    content, calls = parse_whole(text, "auto")
    assert calls == [] and content == text
    assert _streamed(text, "auto")[0] == text


@pytest.mark.parametrize("extra", [{"n": 2, "response_format": {"type": "json_object"}},
                                   {"n": 3, "tools": [WEATHER], "tool_choice": "required"},
                                   {"use_beam_search": True, "n": 2, "guided_choice": ["a", "b"]}])
def test_a_request_no_engine_kind_can_serve_is_a_400_not_a_503(extra):
    with pytest.raises(InvalidRequest, match="no engine kind does both"):
        parse_chat(chat(**extra))
