"""The Anthropic Messages API with the official `anthropic` SDK against a live gateway and sim workers over
gRPC: messages.create and messages.stream, system, stop_sequences and the stop_reason they give,
sampling fields through extra_body, usage with cache_read_input_tokens, count_tokens, x-api-key, and
every bad input a 4xx in Anthropic's error shape before any work. (Tool calls that parse need a real
model: tests/realmodel/test_real_messages.py.)"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.support.stack import model_dir

MODEL = model_dir().name
KEY = "sk-messages-test"


@pytest.fixture(scope="module")
def stack(make_stack):  # tests/gateway/conftest.py
    return make_stack(auth={"api_keys": [KEY]})


@pytest.fixture
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key=KEY, max_retries=0)


ASK = [{"role": "user", "content": "Tell me a story."}]


def test_create_answers_with_a_text_block_usage_and_stop_reason(client):
    m = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 0
    assert m.usage.cache_read_input_tokens == 0


def test_system_and_blocks_are_the_prompt_count_tokens_counts(client, stack):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    m = client.messages.create(model=MODEL, max_tokens=1, messages=messages, system=[{"type": "text",
                                                                                     "text": "Be brief."}])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    assert counted.input_tokens == httpx.post(stack.url + "/tokenize", json={"messages": chat}).json()["count"]


def test_a_repeated_long_prompt_reads_the_cache(client):
    system = "You are a careful assistant. " * 40
    kw = {"model": MODEL, "max_tokens": 2, "messages": ASK, "system": system,
          "extra_headers": {"x-session-id": "anthropic-cache"}}
    first = client.messages.create(**kw)
    second = client.messages.create(**kw)
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 16
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == (
        first.usage.input_tokens + first.usage.cache_read_input_tokens)


def test_stop_sequences_end_the_text_and_name_the_one_that_matched(client):
    base = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0.0})
    text = base.content[0].text
    stop = text[3:5]
    assert stop.strip(), "the sim's text should have two visible characters there"
    m = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0.0},
                               stop_sequences=["never-there", stop])
    assert m.content[0].text == text[: text.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_sampling_fields_from_extra_body_are_read(client):
    a = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body={"temperature": 0.0})
    b = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body={"temperature": 0.0,
                                                                                   "top_k": 5, "top_p": 0.9})
    assert a.content[0].text and b.content[0].text
    with pytest.raises(anthropic.BadRequestError, match="top_p"):
        client.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body={"top_p": 5})


def test_stream_sends_anthropics_event_sequence_and_the_same_text(client):
    whole = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body={"temperature": 0.0})
    with client.messages.stream(model=MODEL, max_tokens=6, messages=ASK, extra_body={"temperature": 0.0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    raw = [e for e in events if e.type == "content_block_delta"]
    assert raw and all(e.delta.type == "text_delta" for e in raw)
    assert "".join(e.delta.text for e in raw) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_bearer_works_and_a_missing_key_is_anthropics_401(stack):
    body = {"model": MODEL, "max_tokens": 1, "messages": ASK}
    assert httpx.post(stack.url + "/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"}
                      ).status_code == 200
    r = httpx.post(stack.url + "/v1/messages", json=body)
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=stack.url, api_key="wrong", max_retries=0).messages.create(**body)


@pytest.mark.parametrize("body, needle", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]}, "tool_use_id"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]}, "image"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": -1, "messages": ASK}, "max_tokens"),
])
def test_bad_input_is_anthropics_400_naming_the_field(stack, body, needle):
    r = httpx.post(stack.url + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]
    assert stack.gateway.pending.count == 0


def test_unknown_model_is_anthropics_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=1, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_a_client_that_leaves_mid_stream_frees_its_request(stack):
    import time

    body = {"model": MODEL, "max_tokens": 2000, "messages": ASK, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30) as r:
        next(r.iter_lines())  # the stream has started
    deadline = time.monotonic() + 10
    while stack.gateway.pending.count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.gateway.pending.count == 0
