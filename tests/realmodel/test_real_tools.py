"""Tool calling on SmolLM2 through the stack with the openai SDK: forced calls always parse and
validate (xgrammar), arguments stream in pieces that add up to the whole call, a tool turn is
answered, and a schema the grammar compiler refuses is a 400 before any work."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


def _check_call(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_parse_and_validate(clients, choice):
    r = clients["prefix"].chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH],
                                                  tool_choice=choice, max_tokens=80, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    _check_call(msg.tool_calls[0])
    if isinstance(choice, dict):
        assert msg.tool_calls[0].function.name == "get_weather"


def test_streamed_call_arrives_in_pieces_that_add_up_to_the_whole_call(clients):
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, SEARCH], "tool_choice": "required",
          "max_tokens": 80, "temperature": 0}
    whole = clients["prefix"].chat.completions.create(**kw).choices[0].message.tool_calls[0]
    pieces, header, finish = [], None, None
    for chunk in clients["prefix"].chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                if tc.id:
                    header = (tc.id, tc.function.name)
                if tc.function and tc.function.arguments:
                    pieces.append(tc.function.arguments)
            finish = choice.finish_reason or finish
    assert header is not None and header[1] == whole.function.name
    assert len(pieces) > 1, "the argument string should stream in several chunks"
    assert "".join(pieces) == whole.function.arguments
    assert finish == "tool_calls"


def test_a_tool_result_turn_gets_an_answer(clients):
    first = clients["prefix"].chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    r = clients["prefix"].chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                  tool_choice="none", max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_auto_answers_with_content_or_calls_that_parse(clients):
    r = clients["prefix"].chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH],
                                                  max_tokens=80, temperature=0)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert msg.content


def test_a_schema_the_grammar_compiler_refuses_is_a_400(clients):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        clients["prefix"].chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required",
                                                  max_tokens=10)
    assert "frobnicate" in str(e.value)


def test_unknown_function_in_tool_choice_is_a_400(clients):
    with pytest.raises(openai.BadRequestError) as e:
        clients["paged"].chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=10,
                                                 tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
