"""The official openai SDK (streaming or not) against the gateway in process, its workers fake engines that answer
as sim workers do (tests/support/fake_engine.py): a fresh gateway and fresh engines per test."""

from __future__ import annotations

import json

import pytest

from tests.support.stack import model_dir

MODEL = model_dir().name


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
            "seed": 7, **kw}


@pytest.fixture
async def stack(fake_gateway):
    return await fake_gateway()  # one prefix and one paged engine


@pytest.fixture
def client(stack):
    return stack.openai()


async def test_chat_non_streaming_has_usage_headers_and_finish_reason(client):
    raw = await client.chat.completions.with_raw_response.create(**chat())
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # fresh engines: nothing of the prompt is cached
    h = raw.headers
    assert h["x-duet-engine"] in ("paged", "prefix")
    assert h["x-duet-worker"].startswith("127.0.0.1:")
    assert h["x-duet-variant"] == "default"
    assert h["x-duet-route-reason"] in ("reuse_low", "reuse_high", "cache_match", "least_load", "affinity")
    assert h["x-request-id"]


async def test_streaming_equals_non_streaming_and_ends_with_usage(client, stack):
    whole = (await client.chat.completions.create(**chat())).choices[0].message.content
    chunks = [c async for c in await client.chat.completions.create(**chat(), stream=True,
                                                                    stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # the raw stream ends with the [DONE] sentinel
    r = await stack.http.post("/v1/chat/completions", json=chat(stream=True))
    lines = [ln for ln in r.text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert r.headers["content-type"].startswith("text/event-stream")


async def test_async_client_completions_with_logprobs(stack):
    client = stack.openai()
    r = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=2, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "length" and len(c.logprobs.tokens) == 5
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, seed=3,
                                             stream=True)
    text = "".join([ch.choices[0].text async for ch in stream])
    assert text == c.text
    await client.close()


async def test_chat_logprobs_and_top_logprobs(client):
    r = await client.chat.completions.create(**chat(max_tokens=4), logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


async def test_n_choices_are_indexed_in_streams_and_go_to_paged(client):
    raw = await client.chat.completions.with_raw_response.create(**chat(max_tokens=4), n=3)
    r = raw.parse()
    assert raw.headers["x-duet-engine"] == "paged" and raw.headers["x-duet-route-reason"] == "capability"
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    indexes = {c.choices[0].index async for c in await client.chat.completions.create(**chat(max_tokens=4), n=2,
                                                                                       stream=True)
               if c.choices}
    assert indexes == {0, 1}


async def test_response_format_routes_to_prefix(client):
    raw = await client.chat.completions.with_raw_response.create(**chat(), response_format={"type": "json_object"})
    assert raw.headers["x-duet-engine"] == "prefix"
    assert raw.headers["x-duet-route-reason"] == "capability"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_token_boundary_is_cut_and_not_returned(client, stream):
    base = await client.completions.create(model=MODEL, prompt="The stop test", max_tokens=16, seed=11, logprobs=0)
    tokens, text = base.choices[0].logprobs.tokens, base.choices[0].text
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(1, len(tokens) - 1)
             if tokens[i] and tokens[i + 1] and "\ufffd" not in tokens[i] + tokens[i + 1])
    stop = tokens[k][-1] + tokens[k + 1][0]
    expected = text[: text.index(stop)]
    kwargs = {"model": MODEL, "prompt": "The stop test", "max_tokens": 16, "seed": 11,
              "stop": ["never-there", stop]}
    if stream:
        chunks = [c async for c in await client.completions.create(**kwargs, stream=True)]
        got = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = await client.completions.create(**kwargs)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
    assert got == expected and stop not in got
    assert finish == "stop"


async def test_cached_tokens_reported_on_a_repeated_prompt_in_one_session(client):
    long = "shared system prompt " * 40
    body = {"model": MODEL, "messages": [{"role": "system", "content": long}, {"role": "user", "content": "hi"}],
            "max_tokens": 2}
    first = await client.chat.completions.create(**body, extra_headers={"x-session-id": "s-cache"})
    second = await client.chat.completions.with_raw_response.create(**body, extra_headers={"x-session-id": "s-cache"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.parse().usage.prompt_tokens_details.cached_tokens >= 16
    assert second.headers["x-duet-route-reason"] == "affinity"


async def test_unknown_fields_are_ignored_and_models_listed(client, stack):
    r = await client.chat.completions.create(**chat(max_tokens=2), extra_body={"some_future_field": {"x": 1}})
    assert r.choices[0].finish_reason == "length"
    assert [m.id async for m in client.models.list()] == [MODEL]
    assert (await stack.http.get("/health")).json() == {"status": "ok"}
    assert (await stack.http.get("/ready")).status_code == 200


async def test_max_completion_tokens_and_metrics(client, stack):
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    text = (await stack.http.get("/metrics")).text
    for name in ("duet_time_to_first_token_seconds_bucket", "duet_inter_token_latency_seconds_bucket",
                 "duet_e2e_request_latency_seconds_bucket", "duet_route_decisions_total",
                 "duet_worker_healthy", "duet_state_store_up", "duet_state_store_errors", "duet_route_estimated_reuse_bucket"):
        assert name in text, name
    assert f'model="{MODEL}"' in text


async def test_sse_error_objects_are_json(stack):
    r = await stack.http.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"


async def test_operator_variant_override_header(client):
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="pin me", max_tokens=1,
                                                      extra_headers={"x-duet-variant": "default"})
    assert raw.headers["x-duet-variant"] == "default" and raw.headers["x-duet-route-reason"] == "override"
