"""engine_prefix end to end over real gRPC on the tiny checkpoint (in-process grpc.aio servers)."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import jsonschema
import pytest
from tokenizers import Tokenizer

from duet.contract import HASH_BLOCK_TOKENS
from duet.engine_config import EngineConfig, PagedConfig, PrefixConfig
from duet.hashing import block_hashes
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from engine_core.worker import Worker
from engine_prefix.worker import build_engine


async def _start(build):
    worker = Worker(build, port=0, drain_timeout=5)
    port = await worker.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return worker, channel, engine_pb2_grpc.EngineStub(channel)


@pytest.fixture
async def engine(tiny_checkpoint):
    worker, channel, stub = await _start(lambda: build_engine(PrefixConfig(EngineConfig(
        model=str(tiny_checkpoint), kv_cache_tokens=8192, max_num_batched_tokens=256), speculative="off")))
    stub.worker = worker
    yield stub
    await channel.close()
    await worker.shutdown()


def request(rid, prompt, salt="", **sampling):
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, cache_salt=salt,
                              sampling=pb.SamplingParams(**sampling))


async def collect(stub, req) -> tuple[list[int], pb.GenerateResponse]:
    tokens, first, last = [], None, None
    async for msg in stub.Generate(req):
        first = first or msg
        last = msg
        tokens.extend(msg.token_ids)
    return tokens, first, last


def shared_prefix_prompts(seed=3, groups=2, per_group=4):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        head = [rng.randrange(3, 1000) for _ in range(rng.randint(40, 90))]
        prompts += [head + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))] for _ in range(per_group)]
    return prompts


async def test_shared_prefixes_match_llm_generate_alone_and_engine_paged(engine, tiny_checkpoint):
    prompts = shared_prefix_prompts()
    greedy = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    results = await asyncio.gather(*[collect(engine, request(f"r{i}", p, **greedy)) for i, p in enumerate(prompts)])
    llm = LLM(tiny_checkpoint)
    want = [llm.generate([p], SamplingParams(**greedy))[0].outputs[0].token_ids for p in prompts]
    assert [r[0] for r in results] == want
    for prompt, (_, first, _) in zip(prompts, results):
        assert first.prompt.prompt_tokens == len(prompt)
    # a second round hits the cache: each group's head (whole pages) at least
    again = await asyncio.gather(*[collect(engine, request(f"s{i}", p, **greedy)) for i, p in enumerate(prompts)])
    assert [r[0] for r in again] == want
    for prompt, (_, first, _) in zip(prompts, again):
        assert first.prompt.cached_tokens >= 32 and first.prompt.cached_tokens < len(prompt)
    load = await engine.GetLoad(pb.GetLoadRequest())
    assert load.prefix_cache_hits_tokens >= sum(r[1].prompt.cached_tokens for r in again) > 0

    from engine_paged.worker import build_engine as build_paged

    worker, channel, paged = await _start(lambda: build_paged(PagedConfig(EngineConfig(
        model=str(tiny_checkpoint), kv_cache_tokens=8192))))
    try:
        got = await asyncio.gather(*[collect(paged, request(f"p{i}", p, **greedy)) for i, p in enumerate(prompts)])
        assert [r[0] for r in got] == want
    finally:
        await channel.close()
        await worker.shutdown()


async def test_tenants_with_different_salts_never_share_the_cache(engine):
    prompt = list(range(100, 180))
    greedy = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    await collect(engine, request("a", prompt, salt="tenant-a", **greedy))
    _, first_b, _ = await collect(engine, request("b", prompt, salt="tenant-b", **greedy))
    _, first_a, _ = await collect(engine, request("a2", prompt, salt="tenant-a", **greedy))
    assert first_b.prompt.cached_tokens == 0
    assert first_a.prompt.cached_tokens == 64


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


async def test_constrained_outputs_always_parse_and_validate(engine, tiny_checkpoint):
    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    schema = json.dumps(SCHEMA)
    free = [collect(engine, request(f"free{i}", [5, 6, 7, i + 8], max_tokens=8, temperature=1.0, seed=i))
            for i in range(5)]  # unconstrained rows in the same batches stay unconstrained
    jobs = [collect(engine, request(f"j{i}", [10 + i, 11, 12], max_tokens=96, temperature=1.0, seed=i,
                                    json_schema=schema)) for i in range(50)]
    results = await asyncio.gather(*jobs, *free)
    for tokens, _, last in results[:50]:
        assert last.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMA)
    assert engine.worker.step_loop.scheduler.grammars.num_compiled == 1  # compiled once for 50 requests
    regex = r"[a-c]{2}-\d{3}"
    reg = await asyncio.gather(*[collect(engine, request(f"re{i}", [20 + i], max_tokens=32, temperature=1.0,
                                                         seed=i, regex=regex)) for i in range(5)])
    import re

    for tokens, _, last in reg:
        assert last.finish_reason == pb.FINISH_REASON_STOP
        assert re.fullmatch(regex, tok.decode(tokens))


@pytest.mark.parametrize("field,value", [("json_schema", '{"type": "nope"}'), ("json_schema", "{not json"),
                                         ("regex", "[a-")])
async def test_invalid_constraint_is_invalid_argument(engine, field, value):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(engine, request("bad", [1, 2, 3], max_tokens=4, **{field: value}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field.split("_")[-1] in err.value.details() or "invalid" in err.value.details()
    load = await engine.GetLoad(pb.GetLoadRequest())
    assert load.num_waiting == 0 and load.num_running == 0


async def test_min_tokens_with_a_grammar_is_refused(engine):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(engine, request("mt", [1, 2, 3], max_tokens=4, min_tokens=2, json_object=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in err.value.details()


async def test_n_and_beam_search_are_refused_with_a_pointer_to_the_paged_engine(engine):
    for extra in ({"n": 2}, {"beam_width": 2}):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(engine, request("multi", [1, 2, 3], max_tokens=4, **extra))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "paged engine" in err.value.details()


async def test_asking_for_speculation_on_a_worker_without_it_is_invalid(engine):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(engine, request("spec", [1, 2, 3], max_tokens=4, speculative=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--speculative ngram" in err.value.details()


async def test_speculation_on_and_off_give_identical_greedy_output(tiny_checkpoint):
    rng = random.Random(11)
    text = [rng.randrange(3, 1000) for _ in range(60)]
    prompts = [text + text[:8], text[10:] + text[10:20], [7, 8, 9] * 20]
    greedy = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    outputs = []
    for speculative in ("off", "ngram"):
        worker, channel, stub = await _start(lambda s=speculative: build_engine(PrefixConfig(
            EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=4096), speculative=s, num_draft_tokens=4)))
        try:
            results = await asyncio.gather(*[collect(stub, request(f"r{i}", p, **greedy))
                                             for i, p in enumerate(prompts)])
            outputs.append([r[0] for r in results])
            load = await stub.GetLoad(pb.GetLoadRequest())
        finally:
            await channel.close()
            await worker.shutdown()
    assert outputs[0] == outputs[1]
    assert load.spec_draft_tokens > 0 and load.spec_accepted_tokens > 0


async def test_a_request_can_turn_speculation_off(tiny_checkpoint):
    worker, channel, stub = await _start(lambda: build_engine(PrefixConfig(
        EngineConfig(model=str(tiny_checkpoint), kv_cache_tokens=4096), speculative="ngram", num_draft_tokens=4)))
    try:
        greedy = {"max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
        off = await collect(stub, request("off", [7, 8, 9] * 20, speculative=False, **greedy))
        assert (await stub.GetLoad(pb.GetLoadRequest())).spec_draft_tokens == 0
        on = await collect(stub, request("on", [7, 8, 9] * 20, speculative=True, **greedy))
        assert (await stub.GetLoad(pb.GetLoadRequest())).spec_draft_tokens > 0
        assert on[0] == off[0]
    finally:
        await channel.close()
        await worker.shutdown()


async def test_cancellation_frees_pages_and_unlocks_nodes(engine):
    prompt = list(range(200, 300))
    call = engine.Generate(request("long", prompt, max_tokens=500, temperature=0.0, ignore_eos=True))
    async for msg in call:
        if msg.token_ids:
            break
    call.cancel()
    scheduler = engine.worker.step_loop.scheduler
    for _ in range(100):
        load = await engine.GetLoad(pb.GetLoadRequest())
        if load.num_running == 0 and load.kv_pages_used == 0:
            break
        await asyncio.sleep(0.05)
    assert load.num_running == 0 and load.kv_pages_used == 0
    assert scheduler.cache.protected_pages == 0
    scheduler.check_integrity()


async def test_kv_events_carry_the_gateway_block_hashes(engine, tiny_checkpoint):
    info = await engine.GetInfo(pb.GetInfoRequest())
    assert info.engine_kind == "prefix" and info.hash_block_size == HASH_BLOCK_TOKENS
    assert "structured_output" in info.capabilities
    events = engine.WatchKvEvents(pb.WatchKvEventsRequest())
    prompt = list(range(300, 340))
    await collect(engine, request("kv", prompt, salt="t1", max_tokens=1, temperature=0.0))
    stored = []
    async for batch in events:
        stored += [h for e in batch.events if e.kind == pb.KvEvent.STORED for h in e.block_hashes]
        if len(stored) >= 2:
            break
    events.cancel()
    assert stored[:2] == block_hashes(prompt, HASH_BLOCK_TOKENS, info.model_id, "t1")
