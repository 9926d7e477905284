"""engine_paged end to end over real gRPC on the tiny checkpoint (in-process grpc.aio server)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from engine_core.worker import Worker
from engine_paged.worker import build_engine


@pytest.fixture
async def engine(tiny_checkpoint):
    build = lambda: build_engine(str(tiny_checkpoint), kv_cache_tokens=8192, page_size=16,
                                 max_num_batched_tokens=256)
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
