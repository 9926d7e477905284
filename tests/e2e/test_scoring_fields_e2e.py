"""logit_bias and prompt logprobs end to end on each engine kind: the official openai SDK -> gateway ->
one real engine_paged or engine_prefix worker on the tiny model over gRPC. Greedy, so token assertions
are exact; prompt logprobs are checked against the engine's own model run by transformers."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from duet.engine_config import EngineConfig, PagedConfig, PrefixConfig
from duet.tokenizer import Tokenizer
from engine_core.worker import Worker
from engine_paged.worker import build_engine as build_paged
from engine_prefix.worker import build_engine as build_prefix
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir

KINDS = ("paged", "prefix")
PROMPT = [5, 17, 99, 42, 7, 230, 64, 12, 18, 33, 71, 5, 17, 99, 42, 8, 150, 3, 66, 21]


@pytest.fixture(params=KINDS)
async def engine(request):
    model = model_dir()
    def engine_config(worker_id: str) -> EngineConfig:
        return EngineConfig(model=str(model), device="cpu", kv_cache_tokens=2048, worker_id=worker_id,
                            max_num_batched_tokens=32)

    build = {"paged": lambda: build_paged(PagedConfig(engine_config("paged-w"))),
             "prefix": lambda: build_prefix(PrefixConfig(engine_config("prefix-w")))}[request.param]
    worker = Worker(build, port=0, drain_timeout=5)
    port = await worker.start()
    gw = GatewayThread(gateway_config([Sim(port=port)]))
    await asyncio.to_thread(gw.start)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield client, model.name, request.param
    finally:
        await client.close()
        await asyncio.to_thread(gw.stop)
        await worker.shutdown()


async def _greedy(client, model, **kw):
    r = await client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True}, **kw)
    return r.choices[0]


async def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one(engine):
    client, model, _ = engine
    tok = Tokenizer.from_dir(model_dir())
    text = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    plain = await _greedy(client, model)
    forced = await _greedy(client, model, logit_bias={"77": 100})
    assert forced.logprobs.tokens == [text[77]] * 6
    # ban every id that reads as greedy's first token: greedy must then start otherwise
    first = plain.logprobs.tokens[0]
    banned = await _greedy(client, model, logit_bias={str(i): -100 for i, t in enumerate(text) if t == first})
    assert banned.logprobs.tokens[0] != first
    assert plain.logprobs.tokens == (await _greedy(client, model)).logprobs.tokens  # nothing leaks to later calls


async def test_a_logit_bias_key_outside_the_vocabulary_is_a_400(engine):
    client, model, _ = engine
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias={"4000000": 5})
    assert e.value.body["param"] == "logit_bias"


async def _reference_logprobs(ids):
    """transformers' log-softmax over the prompt, in a thread: the worker shares this test's event loop,
    and a blocked loop misses the gateway's health polls."""
    return await asyncio.to_thread(_hf_logprobs, ids)


def _hf_logprobs(ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


async def test_echo_scores_the_prompt_like_transformers_and_a_cached_prefix_changes_nothing(engine):
    client, model, kind = engine
    ref = await _reference_logprobs(PROMPT)
    want = [ref[i - 1, t].item() for i, t in enumerate(PROMPT) if i]
    for attempt in range(2):  # the second time the prompt's pages are in the prefix cache
        r = await client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(PROMPT)
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4), (kind, attempt)
        for i in range(1, len(PROMPT)):  # the best alternative is the model's best after i - 1 tokens
            # (keyed by token text, as OpenAI's shape is: the tiny model's byte tokens may share one)
            assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)
        assert r.usage.completion_tokens == 0
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # scoring recomputes: no logits are cached
    # plain requests still hit the cache afterwards
    await client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    again = await client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_vllm_prompt_logprobs_in_a_chunked_prefill_with_generation(engine):
    """100 prompt tokens in chunks of at most 32 (the workers' token budget per step)."""
    client, model, _ = engine
    long = (PROMPT * 6)[:100]
    ref = await _reference_logprobs(long)
    r = await client.completions.create(model=model, prompt=long, max_tokens=3, temperature=0,
                                        extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(long)
    for i in range(1, len(long)):
        assert plp[i][str(long[i])]["logprob"] == pytest.approx(ref[i - 1, long[i]].item(), abs=1e-4)
        best = ref[i - 1].argmax().item()  # the top alternative, keyed by token id
        assert plp[i][str(best)]["logprob"] == pytest.approx(ref[i - 1, best].item(), abs=1e-4)
    assert r.usage.completion_tokens == 3
