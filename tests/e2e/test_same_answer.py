"""Same request, same answer on either kind: real engine_paged and engine_prefix workers on the tiny model,
one gateway whose routing has one variant per kind (loadtests.experiments.engine_diff.ROUTING), the openai SDK pinning
each request to a kind with `x-duet-variant`. Greedy and seeded sampling give the same tokens and logprobs
(within fp32 tolerance); where a capability exists on one kind only, the difference is asserted as such
(and `duet bench diff`'s report lists it)."""

from __future__ import annotations

import openai
import pytest

from duet.engine_config import EngineConfig, PagedConfig, PrefixConfig
from engine_paged.worker import build_engine as build_paged
from engine_prefix.worker import build_engine as build_prefix
from loadtests.experiments import engine_diff
from tests.support.stack import GatewayThread, RealWorkers, Sim, gateway_config, model_dir

ATOL = engine_diff.LOGPROB_ATOL
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def stack():
    model = str(model_dir())

    def engine(worker_id: str) -> EngineConfig:
        return EngineConfig(model=str(model), device="cpu", kv_cache_tokens=4096, worker_id=worker_id)

    workers = RealWorkers([lambda: build_paged(PagedConfig(engine("paged-w"))),
                           lambda: build_prefix(PrefixConfig(engine("prefix-w")))])
    gw = GatewayThread(gateway_config([Sim(port=p) for p in workers.ports], routing=engine_diff.ROUTING)).start(
        wait_workers=2)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield client, model_dir().name, gw.url
    finally:
        client.close()
        gw.stop()
        workers.stop()


def both(client, create, **kwargs) -> dict:
    """kind -> parsed response, each pinned to its kind (and checked that it was)."""
    out = {}
    for kind in engine_diff.KINDS:
        raw = create.with_raw_response.create(**kwargs, extra_headers={"x-duet-variant": kind})
        assert raw.headers["x-duet-engine"] == kind
        out[kind] = raw.parse()
    return out


def assert_same_chat_logprobs(a, b):
    ta, tb = a.logprobs.content, b.logprobs.content
    assert [t.token for t in ta] == [t.token for t in tb]
    for x, y in zip(ta, tb):
        assert x.logprob == pytest.approx(y.logprob, abs=ATOL)
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        assert [t.logprob for t in x.top_logprobs] == pytest.approx([t.logprob for t in y.top_logprobs], abs=ATOL)


def test_greedy_chat_same_tokens_and_logprobs(stack):
    client, model, _ = stack
    r = both(client, client.chat.completions, model=model, messages=CHAT, max_tokens=16, temperature=0,
             logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    p, q = r["paged"].choices[0], r["prefix"].choices[0]
    assert p.message.content == q.message.content and p.finish_reason == q.finish_reason == "length"
    assert_same_chat_logprobs(p, q)
    assert r["paged"].usage.completion_tokens == r["prefix"].usage.completion_tokens == 16
    assert r["paged"].usage.prompt_tokens == r["prefix"].usage.prompt_tokens


def test_seeded_sampling_same_on_both_kinds(stack):
    client, model, _ = stack
    for seed in (1, 7):
        r = both(client, client.chat.completions, model=model, messages=CHAT, max_tokens=16, temperature=0.8,
                 top_p=0.95, seed=seed, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        p, q = r["paged"].choices[0], r["prefix"].choices[0]
        assert p.message.content == q.message.content
        assert_same_chat_logprobs(p, q)


def test_completions_seeded_with_logprobs(stack):
    client, model, _ = stack
    r = both(client, client.completions, model=model, prompt="Once upon a time", max_tokens=12, temperature=0.7,
             seed=3, logprobs=2, extra_body={"ignore_eos": True})
    p, q = r["paged"].choices[0], r["prefix"].choices[0]
    assert p.text == q.text and p.logprobs.tokens == q.logprobs.tokens
    assert p.logprobs.token_logprobs == pytest.approx(q.logprobs.token_logprobs, abs=ATOL)


def test_stop_string_cuts_both_kinds_at_the_same_place(stack):
    client, model, _ = stack
    free = both(client, client.completions, model=model, prompt="The list: a, b,", max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})["paged"].choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), f"greedy text too short to pick a stop string from: {free!r}"
    r = both(client, client.completions, model=model, prompt="The list: a, b,", max_tokens=16, temperature=0,
             stop=[stop], extra_body={"ignore_eos": True})
    p, q = r["paged"].choices[0], r["prefix"].choices[0]
    assert p.text == q.text == free[:free.index(stop)]
    assert p.finish_reason == q.finish_reason == "stop"


def test_n_with_a_seed_is_paged_only_says_so_and_its_choices_match_single_seeded_requests(stack):
    client, model, _ = stack
    kwargs = {"model": model, "prompt": "Hello", "max_tokens": 8, "n": 2, "temperature": 0.9, "seed": 5,
              "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**kwargs, extra_headers={"x-duet-variant": "paged"})
    again = client.completions.create(**kwargs, extra_headers={"x-duet-variant": "paged"})
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # the seed fixes both samples
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**kwargs, extra_headers={"x-duet-variant": "prefix"})
    assert e.value.status_code == 503 and "prefix" in str(e.value)
    # choice i of a seeded n is sampled from seed + i: the prefix kind gives the same samples one by one
    single = {**kwargs, "n": 1}
    for i, choice in enumerate(first.choices):
        alone = client.completions.create(**{**single, "seed": kwargs["seed"] + i},
                                          extra_headers={"x-duet-variant": "prefix"})
        assert alone.choices[0].text == choice.text


def test_json_schema_is_prefix_only_and_says_so(stack):
    client, model, _ = stack
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kwargs = {"model": model, "messages": [{"role": "user", "content": "answer"}], "max_tokens": 20,
              "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    out = client.chat.completions.create(**kwargs, extra_headers={"x-duet-variant": "prefix"})
    assert out.choices[0].message.content.replace(" ", "") in ('{"ok":true}', '{"ok":false}')
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**kwargs, extra_headers={"x-duet-variant": "paged"})
    assert e.value.status_code == 503 and "paged" in str(e.value)


def test_bench_diff_reports_same_answers_and_lists_one_kind_capabilities(stack):
    _, model, url = stack
    bodies = [
        {"model": "team-model", "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True},
        {"model": "team-model", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "seed": 11},
        {"model": "team-model", "prompt": "Hi", "max_tokens": 4, "n": 2, "seed": 2},
        {"model": "team-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
         "response_format": {"type": "json_object"}},
    ]
    report = engine_diff.run_diff(url, bodies, model=model, repeats=2)
    diffs = [[(d["field"], d["detail"]) for d in row["differences"]] for row in report["rows"]]
    assert diffs[0] == [] and diffs[1] == []
    assert [f for f, _ in diffs[2]] == ["capability"] and diffs[2][0][1].startswith("only paged serves it")
    assert [f for f, _ in diffs[3]] == ["capability"] and diffs[3][0][1].startswith("only prefix serves it")
    assert report["same"] == 2 and report["by_field"] == {"capability": 2}
    # the 2 requests both kinds served, twice each, plus the one only it serves
    assert report["latency_s"]["paged"]["n"] == report["latency_s"]["prefix"]["n"] == 6
    table = engine_diff.format_report(report)
    assert "2 of 4 requests answered alike" in table and "only prefix serves it" in table
