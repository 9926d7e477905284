"""The Anthropic Messages API on SmolLM2 (engine_prefix, xgrammar) with the `anthropic` SDK: a forced tool
comes out as a tool_use block whose input validates, its tool_result goes back and gets a text answer,
and a streamed tool_use's input_json_delta pieces add up to the block's input."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": SCHEMA}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(real_stack):
    return anthropic.Anthropic(base_url=real_stack.url("prefix"), api_key="k", max_retries=0, timeout=300)


def test_a_tool_use_round_trip(client):
    first = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, SCHEMA)
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                              "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]}]
    second = client.messages.create(model=MODEL, max_tokens=40, messages=messages, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert second.content[0].type == "text" and second.content[0].text.strip()
    assert second.stop_reason in ("end_turn", "max_tokens")


def test_streamed_tool_input_adds_up(client):
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert pieces and final.content[-1].type == "tool_use"
    assert json.loads("".join(pieces)) == final.content[-1].input
    jsonschema.validate(final.content[-1].input, SCHEMA)
    assert final.stop_reason == "tool_use"
