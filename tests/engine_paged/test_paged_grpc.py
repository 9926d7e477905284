"""engine_paged end to end over real gRPC on the tiny checkpoint (in-process grpc.aio server)."""

from __future__ import annotations

import asyncio
import functools
import random

import grpc
import pytest

from duet.engine_config import EngineConfig, PagedConfig
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from engine_core.worker import Worker
from engine_paged.worker import build_engine


@pytest.fixture
async def engine(tiny_checkpoint):
    build = lambda: build_engine(PagedConfig(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=8192,
                                                          page_size=16, max_num_batched_tokens=256)))
    worker = Worker(build, port=0, drain_timeout=5)
    port = await worker.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine_pb2_grpc.EngineStub(channel)
    await channel.close()
    await worker.shutdown()


def request(rid, prompt, **sampling):
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling))


async def collect(stub, req) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for msg in stub.Generate(req):
        if msg.replaces_previous:
            out[msg.index] = list(msg.token_ids)
        else:
            out.setdefault(msg.index, []).extend(msg.token_ids)
    return out


async def test_concurrent_ragged_requests_match_llm_generate_alone(engine, tiny_checkpoint):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 300))] for _ in range(16)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    results = await asyncio.gather(*[
        collect(engine, request(f"r{i}", p, max_tokens=m, temperature=0.0, ignore_eos=True))
        for i, (p, m) in enumerate(zip(prompts, max_tokens))])
    llm = LLM(tiny_checkpoint)
    for prompt, m, got in zip(prompts, max_tokens, results):
        want = llm.generate([prompt], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        assert got[0] == want[0].outputs[0].token_ids


async def test_n4_with_seed_is_reproducible(engine):
    req = request("n4", list(range(10, 50)), max_tokens=12, temperature=1.0, seed=42, n=4, ignore_eos=True)
    first = await collect(engine, req)
    second = await collect(engine, request("n4b", list(range(10, 50)), max_tokens=12, temperature=1.0, seed=42,
                                           n=4, ignore_eos=True))
    assert sorted(first) == [0, 1, 2, 3] and all(len(v) == 12 for v in first.values())
    assert first == second
    assert len({tuple(v) for v in first.values()}) > 1  # different seeds per index


async def test_cancelling_a_stream_returns_its_pages(engine):
    call = engine.Generate(request("gone", list(range(1, 200)), max_tokens=1500, ignore_eos=True))
    await call.read()
    load = await engine.GetLoad(pb.GetLoadRequest())
    assert load.kv_pages_used > 0 and load.num_running == 1
    call.cancel()
    for _ in range(200):
        load = await engine.GetLoad(pb.GetLoadRequest())
        if load.kv_pages_used == 0:
            break
        await asyncio.sleep(0.02)
    assert load.kv_pages_used == 0 and load.num_running == 0


async def test_beam_search_sends_whole_ranked_beams(engine):
    msgs = [m async for m in engine.Generate(request("beam", [5, 6, 7], max_tokens=6, beam_width=3, n=2,
                                                          ignore_eos=True))]
    assert [m.index for m in msgs] == [0, 1]
    assert all(m.replaces_previous and len(m.token_ids) == 6 for m in msgs)
    assert msgs[0].cumulative_logprob >= msgs[1].cumulative_logprob
    assert msgs[0].prompt.prompt_tokens == 3


@pytest.mark.parametrize("prompt_len, sampling, needle", [
    (2048, {"max_tokens": 1}, "context"),
    (4, {"max_tokens": 1, "top_p": 0.0}, "top_p"),
    (4, {"max_tokens": 2, "beam_width": 2, "n": 3}, "beam_width"),
    (4, {"max_tokens": 2, "regex": "a+"}, "structured output"),
    (4, {"max_tokens": 2, "speculative": True}, "speculative decoding is not supported"),
])
async def test_bad_arguments_are_invalid_argument(engine, prompt_len, sampling, needle):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(engine, request("bad", [3] * prompt_len, **sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


async def test_info_reports_the_engine(engine):
    info = await engine.GetInfo(pb.GetInfoRequest())
    assert info.engine_kind == "paged" and info.page_size == 16 and info.kv_total_pages == 512
    assert {"n", "beam_search"} <= set(info.capabilities) and info.vocab_size == 1000


# -- automatic prefix caching ----------------------------------------------------------------------
async def first_message(stub, req):
    msgs = [m async for m in stub.Generate(req)]
    return msgs[0], [t for m in msgs for t in m.token_ids]


async def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_output(engine):
    prompt = list(range(100, 200))  # 100 tokens: 6 full pages of 16
    first, tokens = await first_message(engine, request("c1", prompt, max_tokens=8, temperature=0.0,
                                                        ignore_eos=True))
    again, tokens_again = await first_message(engine, request("c2", prompt, max_tokens=8, temperature=0.0,
                                                              ignore_eos=True))
    assert first.prompt.cached_tokens == 0 and again.prompt.cached_tokens == 96
    assert tokens_again == tokens
    salted, _ = await first_message(engine, pb.GenerateRequest(
        request_id="c3", prompt_token_ids=prompt, cache_salt="other tenant",
        sampling=pb.SamplingParams(max_tokens=1, temperature=0.0)))
    assert salted.prompt.cached_tokens == 0
    load = await engine.GetLoad(pb.GetLoadRequest())
    assert load.prefix_cache_hits_tokens == 96 and load.prefix_cache_queries_tokens == 300


async def test_outputs_are_the_same_with_caching_on_and_off(tiny_checkpoint):
    rng = random.Random(11)
    heads = [[rng.randrange(3, 1000) for _ in range(70)] for _ in range(2)]
    prompts = [rng.choice(heads) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    results = {}
    for caching in (True, False):
        config = PagedConfig(EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=4096, page_size=16),
                             enable_prefix_caching=caching)
        worker = Worker(functools.partial(build_engine, config), port=0, drain_timeout=5)
        port = await worker.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            got = []
            for i, p in enumerate(prompts):  # one at a time, so later prompts find earlier ones cached
                first, tokens = await first_message(stub, request(f"r{i}", p, max_tokens=10, temperature=0.0,
                                                                  ignore_eos=True))
                got.append((tokens, first.prompt.cached_tokens))
            n_out = await collect(stub, request("n", prompts[0], max_tokens=6, n=3, temperature=0.0, ignore_eos=True))
            beams = await collect(stub, request("b", prompts[0], max_tokens=6, beam_width=2, ignore_eos=True))
        await worker.shutdown()
        results[caching] = (got, n_out, beams)
    on, off = results[True], results[False]
    assert [t for t, _ in on[0]] == [t for t, _ in off[0]] and on[1:] == off[1:]
    assert all(c == 0 for _, c in off[0]) and sum(c for _, c in on[0]) >= 6 * 64


async def test_kv_events_let_the_gateway_index_paged_workers(engine):
    from duet.hashing import block_hashes

    info = await engine.GetInfo(pb.GetInfoRequest())
    assert info.hash_block_size == info.page_size == 16
    events = engine.WatchKvEvents(pb.WatchKvEventsRequest())
    prompt = list(range(300, 340))
    await collect(engine, pb.GenerateRequest(request_id="kv", prompt_token_ids=prompt, cache_salt="t1",
                                             sampling=pb.SamplingParams(max_tokens=1, temperature=0.0)))
    stored = []
    async for batch in events:
        stored += [h for e in batch.events if e.kind == pb.KvEvent.STORED for h in e.block_hashes]
        if len(stored) >= 2:
            break
    events.cancel()
    assert stored[:2] == block_hashes(prompt, 16, info.model_id, "t1")
