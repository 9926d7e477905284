"""The Responses API with the official openai SDK (`client.responses`) against live gateways and sim
workers over gRPC: create from a string or items, instructions, stored responses (get, delete),
previous_response_id continuing on another gateway replica through Redis and keeping the session's
worker, the streaming event sequence, and each bad input a 4xx OpenAI error before any work.
(Tool calls that parse need a real model: tests/realmodel/test_real_responses.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.stack import model_dir

MODEL = model_dir().name


@pytest.fixture(scope="module")
def stack(make_stack, redis_url):  # two gateway replicas sharing Redis and the workers
    return make_stack(("prefix", "paged", "paged"), replicas=2, redis=redis_url)


@pytest.fixture
def clients(stack):
    return [openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0) for g in stack]


def test_create_from_a_string_has_output_text_and_usage(clients):
    session = {"x-session-id": "responses-usage"}
    r = clients[0].responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0.5,
                                    extra_headers=session)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    # the same input again, on the same worker (the session's): every whole 16-token block of it is cached
    again = clients[0].responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0.5,
                                        extra_headers=session)
    assert again.usage.input_tokens == r.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == r.usage.input_tokens // 16 * 16 > 0
    assert r.temperature == 0.5 and r.max_output_tokens == 8


def test_instructions_and_items_become_the_chat_the_model_sees(clients, stack):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "How are you?"}]
    r = clients[0].responses.create(model=MODEL, input=items, instructions="Be brief.", max_output_tokens=2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    count = httpx.post(stack[0].url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
    assert r.usage.input_tokens == count
    assert r.instructions == "Be brief."


def test_a_stored_response_continues_on_another_replica_on_the_same_worker(clients):
    first = clients[0].responses.with_raw_response.create(model=MODEL, input="Remember the word: apple.",
                                                          max_output_tokens=4)
    r1 = first.parse()
    # the other gateway replica reads it from Redis
    assert clients[1].responses.retrieve(r1.id).output_text == r1.output_text
    second = clients[1].responses.with_raw_response.create(model=MODEL, input="What was the word?",
                                                           previous_response_id=r1.id, max_output_tokens=4)
    r2 = second.parse()
    assert r2.previous_response_id == r1.id
    # the conversation so far (first input + answer) came first: more input tokens, some of them cached
    assert r2.usage.input_tokens > r1.usage.input_tokens
    assert second.headers["x-duet-worker"] == first.headers["x-duet-worker"]
    assert second.headers["x-duet-route-reason"] == "affinity"
    third = clients[0].responses.with_raw_response.create(model=MODEL, input="And again?",
                                                          previous_response_id=r2.id, max_output_tokens=2)
    assert third.headers["x-duet-worker"] == first.headers["x-duet-worker"]  # the whole conversation stays
    assert third.parse().usage.input_tokens_details.cached_tokens > 0


def test_delete_then_retrieve_and_continue_are_404s(clients):
    r = clients[0].responses.create(model=MODEL, input="x", max_output_tokens=1)
    deleted = clients[1].responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        clients[0].responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        clients[0].responses.create(model=MODEL, input="y", previous_response_id=r.id, max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        clients[0].responses.delete(r.id)


def test_store_false_keeps_nothing(clients):
    r = clients[0].responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        clients[1].responses.retrieve(r.id)


def test_streaming_sends_the_responses_event_sequence(clients):
    whole = clients[0].responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=6, temperature=0)
    events = list(clients[0].responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=6,
                                              temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 6


def test_json_schema_format_routes_to_structured_output(clients):
    raw = clients[0].responses.with_raw_response.create(
        model=MODEL, input="a city", max_output_tokens=4,
        text={"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}}})
    assert raw.headers["x-duet-engine"] == "prefix" and raw.headers["x-duet-route-reason"] == "capability"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
])
def test_bad_input_is_a_400_naming_the_field(stack, body, param):
    r = httpx.post(stack[0].url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert stack[0].gateway.pending.count == 0


def test_a_function_call_round_trip_in_items_is_accepted(clients):
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}]
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    r = clients[0].responses.create(model=MODEL, input=items, tools=tools, tool_choice="none", max_output_tokens=3)
    assert r.output[0].type == "message" and r.usage.output_tokens == 3


def test_a_client_that_leaves_mid_stream_frees_its_request(stack):
    import time

    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 2000, "stream": True}
    with httpx.stream("POST", stack[0].url + "/v1/responses", json=body, timeout=30) as r:
        next(r.iter_lines())  # the stream has started
    deadline = time.monotonic() + 10
    while stack[0].gateway.pending.count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack[0].gateway.pending.count == 0
