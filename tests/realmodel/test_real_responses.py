"""The Responses API on SmolLM2 (engine_prefix, xgrammar) with the openai SDK: a forced function call
comes out as a function_call item whose arguments validate, its output goes back in with
previous_response_id and gets an answer, and a streamed call's argument deltas add up to the call."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": PARAMS}


@pytest.fixture(scope="module")
def client(real_stack):
    return openai.OpenAI(base_url=real_stack.url("prefix") + "/v1", api_key="k", max_retries=0, timeout=300)


def test_a_tool_round_trip_with_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="What is the weather like in Paris today?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
    answer = [{"type": "function_call_output", "call_id": calls[0].call_id,
               "output": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    kw = {"model": MODEL, "tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 40, "temperature": 0}
    second = client.responses.create(previous_response_id=first.id, input=answer, **kw)
    assert second.output[0].type == "message" and second.output_text.strip()
    with pytest.raises(openai.BadRequestError):  # without the stored conversation the output answers no call
        client.responses.create(input=answer, **kw)


def test_streamed_function_call_arguments_add_up(client):
    kw = {"model": MODEL, "input": "What is the weather like in Rome?", "tools": [WEATHER],
          "tool_choice": "required", "max_output_tokens": 60, "temperature": 0}
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments
    jsonschema.validate(json.loads(done.arguments), PARAMS)
    final = events[-1].response.output
    assert final[-1].type == "function_call" and final[-1].arguments == done.arguments
