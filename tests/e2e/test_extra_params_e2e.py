"""vLLM's extra parameters end to end: the official openai SDK (`extra_body`) -> gateway -> routing step 2
(capability) -> real engine_paged / engine_prefix workers on the tiny model over gRPC."""

from __future__ import annotations

import asyncio

import openai
import pytest

from duet.engine_config import EngineConfig, PagedConfig, PrefixConfig
from engine_core.worker import Worker
from engine_paged.worker import build_engine as build_paged
from engine_prefix.worker import build_engine as build_prefix
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir


@pytest.fixture
async def stack():
    model = model_dir()
    workers = [
        Worker(lambda: build_paged(PagedConfig(EngineConfig(model=str(model), kv_cache_tokens=2048,
                                                            worker_id="paged-w"))), port=0, drain_timeout=5),
        Worker(lambda: build_prefix(PrefixConfig(EngineConfig(model=str(model), kv_cache_tokens=2048,
                                                              worker_id="prefix-w"),
                                                 speculative="ngram", num_draft_tokens=4)),
               port=0, drain_timeout=5),
    ]
    ports = [await w.start() for w in workers]
    gw = GatewayThread(gateway_config([Sim(port=p) for p in ports]))
    await asyncio.to_thread(gw.start)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield client, model.name
    finally:
        await client.close()
        await asyncio.to_thread(gw.stop)
        for w in workers:
            await w.shutdown()


async def test_beam_search_reaches_the_paged_engine_and_returns_n_ranked_beams(stack):
    client, model = stack
    raw = await client.completions.with_raw_response.create(
        model=model, prompt="The quick brown fox", max_tokens=5, n=2,
        extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 1.0, "ignore_eos": True})
    assert raw.headers["x-duet-engine"] == "paged" and raw.headers["x-duet-route-reason"] == "capability"
    out = raw.parse()
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text and out.usage.completion_tokens == 10


async def test_guided_choice_answers_with_one_of_the_choices_from_the_prefix_engine(stack):
    client, model = stack
    choices = ["alpha", "beta gamma", "42"]
    for seed in range(3):
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "pick one"}], max_tokens=20, seed=seed,
            extra_body={"guided_choice": choices})
        assert raw.headers["x-duet-engine"] == "prefix"
        assert raw.parse().choices[0].message.content in choices


async def test_per_request_speculation_is_routed_and_gives_the_same_greedy_text(stack):
    client, model = stack
    texts = {}
    for speculative in (True, False):
        raw = await client.completions.with_raw_response.create(
            model=model, prompt="one two three one two three one two", max_tokens=12, temperature=0,
            extra_body={"speculative": speculative, "ignore_eos": True})
        texts[speculative] = raw.parse().choices[0].text
        if speculative:
            assert raw.headers["x-duet-engine"] == "prefix"
    assert texts[True] == texts[False]


async def test_an_impossible_mix_is_a_clear_error(stack):
    client, model = stack
    with pytest.raises(openai.BadRequestError, match="best_of"):
        await client.completions.create(model=model, prompt="x", max_tokens=2, n=3,
                                        extra_body={"use_beam_search": True, "best_of": 2})
