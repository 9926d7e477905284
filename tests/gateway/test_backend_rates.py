"""An external backend's prefill and decode rates from its own /metrics counters
(gateway/backends/backend_load.py `BusyRates`): two successive pages give the rates while busy, an idle
interval keeps them, a server restart (counters back to small values) gives neither a negative nor a huge
rate, and HttpBackendClient's polls carry them on the EngineLoad that routing reads."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gateway.backends.backend_load import NAMES, BusyRates, engine_load
from gateway.backends.backend_spec import BackendSpec
from gateway.backends.http_backend import HttpBackendClient
from tests.support.backend_stub import stub_backend


def page(prefill_tokens: float, prefill_s: float, itl_s: float, itl_n: float, steps: float) -> str:
    """A vLLM 0.32 /metrics page as the gateway asks for it (name[] filter: `_sum`/`_count`, no buckets),
    two engine indexes, each carrying half of every counter."""
    labels = ['{engine="0",model_name="m"}', '{engine="1",model_name="m"}']
    rows = [("vllm:request_prefill_kv_computed_tokens_sum", prefill_tokens),
            ("vllm:request_prefill_time_seconds_sum", prefill_s),
            ("vllm:inter_token_latency_seconds_sum", itl_s),
            ("vllm:inter_token_latency_seconds_count", itl_n),
            ("vllm:iteration_tokens_total_count", steps)]
    lines = ["# HELP vllm:num_requests_running x", "# TYPE vllm:num_requests_running gauge",
             f"vllm:num_requests_running{labels[0]} 3.0"]
    lines += [f"{name}{lab} {value / 2}" for name, value in rows for lab in labels]
    return "\n".join(lines) + "\n"


FIRST = page(prefill_tokens=1000, prefill_s=2.0, itl_s=5.0, itl_n=200, steps=100)
# since FIRST: requests that computed 1,200 prompt tokens in 0.6 s of prefill (2,000 tokens/s); 40 tokens
# decoded 0.02 s apart over 10 steps, four a step (four tokens per 0.02 s: 200 tokens/s)
SECOND = page(prefill_tokens=2200, prefill_s=2.6, itl_s=5.8, itl_n=240, steps=110)


def test_two_pages_give_the_rates_while_busy():
    rates = BusyRates()
    first = engine_load(FIRST, "vllm", rates)
    assert (first.prefill_tokens_per_s, first.decode_tokens_per_s) == (0.0, 0.0)  # one reading: no rate yet
    second = engine_load(SECOND, "vllm", rates)
    assert second.num_running == 3
    assert second.prefill_tokens_per_s == pytest.approx(2000.0)
    assert second.decode_tokens_per_s == pytest.approx(200.0)


def test_an_idle_interval_keeps_the_last_rates():
    rates = BusyRates()
    for text in (FIRST, SECOND):
        engine_load(text, "vllm", rates)
    idle = engine_load(SECOND, "vllm", rates)  # nothing finished, nothing decoded since
    assert idle.prefill_tokens_per_s == pytest.approx(2000.0)
    assert idle.decode_tokens_per_s == pytest.approx(200.0)
    # only decoding since (no request finished): the prefill rate stays, the decode rate is the new interval's
    # 30 tokens 0.05 s apart over 10 steps: 3 a step, 60 tokens/s
    decoding = engine_load(page(2200, 2.6, 5.8 + 1.5, 270, 120), "vllm", rates)
    assert decoding.prefill_tokens_per_s == pytest.approx(2000.0)
    assert decoding.decode_tokens_per_s == pytest.approx(60.0)


def test_a_server_restart_gives_no_negative_or_huge_rate():
    rates = BusyRates()
    for text in (FIRST, SECOND):
        engine_load(text, "vllm", rates)
    # restarted: every counter from zero again, a few requests already served
    restarted = engine_load(page(50, 0.01, 0.1, 5, 4), "vllm", rates)
    assert restarted.prefill_tokens_per_s == pytest.approx(2000.0)  # the last rates, not 2,150 / -2.59 s
    assert restarted.decode_tokens_per_s == pytest.approx(200.0)
    # the restarted server's reading is the baseline: 900 tokens in 0.3 s since it
    after = engine_load(page(950, 0.31, 0.1 + 0.4, 25, 9), "vllm", rates)
    assert after.prefill_tokens_per_s == pytest.approx(3000.0)
    assert after.decode_tokens_per_s == pytest.approx(20 / (5 * 0.02))  # 20 tokens, 0.02 s apart, 5 steps


def test_sglang_reports_no_rate_and_the_gateway_falls_back_to_its_own():
    rates = BusyRates()
    for text in ("sglang:num_running_reqs 2\nsglang:prompt_tokens_total 100\n",
                 "sglang:num_running_reqs 2\nsglang:prompt_tokens_total 900\n"):
        load = engine_load(text, "sglang", rates)
    assert (load.num_running, load.prefill_tokens_per_s, load.decode_tokens_per_s) == (2, 0.0, 0.0)


def test_the_http_backend_polls_carry_the_rates_and_ask_for_their_series():
    pages = iter([FIRST, SECOND, SECOND])
    asked: list[list[str]] = []

    async def handler(request: web.Request) -> web.Response:
        assert request.path == "/metrics"
        asked.append(request.query.getall("name[]", []))
        return web.Response(text=next(pages))

    async def run() -> list:
        async with stub_backend(handler) as url:
            client = HttpBackendClient(BackendSpec(engine="vllm", url=url, kind="paged"), {}, 16)
            try:
                return [await client.get_load() for _ in range(3)]
            finally:
                await client.close()

    loads = asyncio.run(run())
    assert [(round(x.prefill_tokens_per_s), round(x.decode_tokens_per_s)) for x in loads] == [
        (0, 0), (2000, 200), (2000, 200)]
    wanted = {"vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prefill_time_seconds_sum",
              "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
              "vllm:iteration_tokens_total_count"}
    assert wanted <= set(asked[0]) and set(asked[0]) == set(NAMES["vllm"].values())


def test_the_page_scan_sums_what_the_prometheus_parser_reads_of_a_whole_vllm_page():
    # vLLM 0.32 ignores name[] and sends its whole page (histogram buckets, HTTP series, names that start with a
    # wanted one): the gateway's scan must read the wanted series as prometheus_client's parser does
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from gateway.backends.backend_load import sample_sums

    text = (Path(__file__).parents[2] / "loadtests/stack/data/vllm_0.32_metrics_page.txt").read_text()
    text += ('vllm:num_requests_running{engine="1",model_name="a} b"} 2.0 1765000000000\n'  # a brace in a label
             "vllm:num_requests_running_by_reason 7.0\n"  # a longer name
             'vllm:num_requests_waiting{engine="1"} 4.0\n' + page(100, 0.5, 0.2, 20, 10))
    for engine in ("vllm", "sglang"):
        names = frozenset(NAMES[engine].values())
        full: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    full[sample.name] = full.get(sample.name, 0.0) + sample.value
        assert sample_sums(text, names) == full
    sums = sample_sums(text, frozenset(NAMES["vllm"].values()))
    assert sums["vllm:num_requests_running"] == 5.0 and sums["vllm:num_requests_waiting"] == 4.0
    assert sums["vllm:iteration_tokens_total_count"] == 38.0 + 10.0  # the captured server's 38 steps, page()'s 10
