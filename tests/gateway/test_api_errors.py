"""Every error status of the API, as OpenAI error objects the SDK understands, each with x-request-id: the
gateway in process in front of fake engines (tests/support/fake_engine.py)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.fake_engine import FakeEngine, Hang, Started, Tokens
from tests.support.fake_gateway import FakeGateway
from tests.support.stack import model_dir

MODEL = model_dir().name
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def gw(fake_gateway):
    return await fake_gateway(FakeEngine("prefix"), FakeEngine("paged"),
                              auth={"api_keys": ["sk-good", {"key": "sk-tenant", "cache_salt": "t1"}]},
                              limits={"max_body_bytes": 20_000, "max_pending_requests": 1})


def client(gw, key="sk-good") -> openai.AsyncOpenAI:
    return gw.openai(key)


async def test_400_invalid_parameter_names_it(gw):
    with pytest.raises(openai.BadRequestError) as e:
        await client(gw).chat.completions.create(model=MODEL, messages=MSG, temperature=5)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature" and "temperature" in e.value.body["message"]
    assert e.value.response.headers["x-request-id"]


async def test_400_context_length_says_both_numbers(gw):
    with pytest.raises(openai.BadRequestError) as e:
        await client(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=100_000)
    body = e.value.body
    assert body["code"] == "context_length_exceeded"
    assert "2048" in body["message"]  # the tiny model's context
    prompt_tokens = int(body["message"].split("you requested ")[1].split(" ")[0]) - 100_000
    assert prompt_tokens > 0


async def test_401_missing_or_bad_key_and_salted_key_works(gw):
    with pytest.raises(openai.AuthenticationError) as e:
        await client(gw, "sk-bad").models.list()
    assert e.value.status_code == 401 and e.value.response.headers["x-request-id"]
    r = await gw.http.get("/v1/models")  # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert (await client(gw, "sk-tenant").chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)).choices
    # /health needs no key
    assert (await gw.http.get("/health")).status_code == 200


async def test_404_unknown_model(gw):
    with pytest.raises(openai.NotFoundError) as e:
        await client(gw).chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]


async def test_413_body_over_the_limit(gw):
    r = await gw.http.post("/v1/completions", headers={"Authorization": "Bearer sk-good"},
                           json={"model": MODEL, "prompt": "x" * 30_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["x-request-id"]


async def test_429_when_the_admission_queue_is_full(gw):
    c = client(gw)
    prefix = gw.engines[0].script([Started(), Tokens([5]), Hang()])  # one token, then it keeps the request
    stream = asyncio.create_task(c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, stream=True,
                                                           response_format={"type": "json_object"}))
    # the one admitted request is now streaming
    assert await gw.wait_for(lambda: any(s.sent == 2 for s in prefix.open_streams))
    try:
        with pytest.raises(openai.RateLimitError) as e:
            await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
        assert e.value.status_code == 429
    finally:
        stream.cancel()


async def test_400_when_no_engine_kind_could_ever_serve_the_request(gw):
    # n > 1 is engine_paged's, structured output engine_prefix's: no worker, healthy or not, does both,
    # so this is the client's error (the 503 for capable workers all down is tested in test_routing)
    with pytest.raises(openai.BadRequestError) as e:
        await client(gw).chat.completions.create(model=MODEL, messages=MSG, n=2, max_tokens=2,
                                                 response_format={"type": "json_object"})
    assert "no engine kind does both" in e.value.body["message"]


async def test_503_and_not_ready_when_no_worker_is_up():
    async with FakeGateway([]) as g:
        r = await g.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert (await g.http.get("/ready")).status_code == 503


async def test_request_id_is_echoed_when_given(gw):
    r = await gw.http.get("/v1/models", headers={"Authorization": "Bearer sk-good", "x-request-id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


async def test_bad_variant_override_is_400(gw):
    r = await gw.http.post("/v1/completions", headers={"Authorization": "Bearer sk-good", "x-duet-variant": "nope"},
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_variant"


async def test_concurrent_bad_requests_do_not_leak_admission(gw):
    errs = []

    async def bad():
        try:
            await client(gw).completions.create(model=MODEL, prompt="hi", max_tokens=1, top_p=0)
        except openai.BadRequestError:
            errs.append(1)

    await asyncio.gather(*(bad() for _ in range(5)))
    assert len(errs) == 5
    r = await client(gw).completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert r.choices[0].finish_reason == "length"


async def test_long_prompt_over_the_context_is_400_with_its_token_count(gw):
    long_text = "lorem ipsum dolor sit amet " * 650  # tokenized off the event loop
    with pytest.raises(openai.BadRequestError) as e:
        await client(gw).completions.create(model=MODEL, prompt=long_text, max_tokens=1)
    msg = e.value.body["message"]
    assert "maximum context length is 2048 tokens" in msg
    requested = int(msg.split("you requested ")[1].split(" ")[0])
    assert requested > 2048
