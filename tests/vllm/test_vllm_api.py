"""Duet's gateway in front of real vLLM (gateway/backends/http_backend.py), with the openai SDK: what a client
of Duet's own engines gets, it gets from vLLM too — the answer, streaming, structured output, forced
tool calls, n, logprobs, cached tokens — and the router's cache view of vLLM, fed by vLLM's own KV
events, matches the cache hits vLLM reports."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from duet.hashing import block_hashes

MODEL = "smollm2-135m-instruct"
# the first test of the tier also installs vLLM (minutes, once) and starts it
pytestmark = pytest.mark.timeout(1800)
PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_paris_comes_from_vllm(client, backend):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=PARIS, max_tokens=12,
                                                           temperature=0)
    assert raw.headers["x-duet-worker"] == backend.url and raw.headers["x-duet-engine"] == "paged"
    assert "paris" in raw.parse().choices[0].message.content.lower()


def test_streaming_adds_up_to_the_whole_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_stay_in_the_gateway(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=[" 8"])
    assert r.choices[0].finish_reason == "stop" and " 8" not in r.choices[0].text and "7" in r.choices[0].text


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_tool_choice_required_calls_the_tool(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                       max_tokens=60, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_n_gives_n_choices(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0,
                                  seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 24


def test_logprobs_are_vllms(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.logprob <= 0
        assert tok.logprob == max(t.logprob for t in tok.top_logprobs)  # greedy: the best one was taken


def _long_prompt(tag: str) -> str:
    return f"Notes {tag}. " + " ".join(f"item {i} is a {tag} thing;" for i in range(90))


def test_cached_tokens_and_the_routers_view_agree(client, gateways, backend):
    gw = gateways["vllm"].gateway
    prompt = _long_prompt("cache")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 300
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (n - 1) // 128 * 128  # vLLM's CPU build caches whole 128-token blocks
    assert gw.pool_tracker.recent[-1] == (0, False)  # the router estimated exactly that (real - estimate, stale)


def test_the_index_is_fed_by_vllms_events(gateways, backend):
    """A prompt sent to vLLM directly (the gateway never routed it) shows up in the router's index."""
    gw = gateways["vllm"].gateway
    tok = gw.models[MODEL].tokenizer
    ids = tok.encode(_long_prompt("direct"), add_special_tokens=True)
    hashes = block_hashes(ids, 16, MODEL)
    assert gw.router.index.match(backend.url, hashes) == 0
    r = httpx.post(backend.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0, "detokenize": False}})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while gw.router.index.match(backend.url, hashes) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gw.router.index.match(backend.url, hashes) * 16 == len(ids) // 128 * 128


def test_backend_load_reaches_the_worker_view(gateways, backend):
    rows = {r["worker_id"]: r for r in gateways["mixed"].gateway.admin.worker_rows()}
    row = rows[backend.url]
    assert row["engine_kind"] == "paged" and row["healthy"] and row["version"] == "external"
    assert 0 <= row["kv_usage"] <= 1


def test_the_metrics_scan_reads_vllms_page_as_the_prometheus_parser_does(backend):
    # gateway/backends/backend_load.py scans only the lines it needs; on vLLM's real page (histograms and all) its sums
    # must equal the full parser's, or routing and the watchdog read a wrong load
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.backends.backend_load import NAMES, sample_sums

    text = httpx.get(backend.url + "/metrics", timeout=5).text
    names = frozenset(NAMES["vllm"].values())
    full: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                full[sample.name] = full.get(sample.name, 0.0) + sample.value
    assert set(full) >= {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total"}
    assert sample_sums(text, names) == full


def test_vllms_counters_give_its_prefill_and_decode_rates(backend):
    """gateway/backends/backend_load.py `BusyRates` on vLLM's real counters (the page asked for as the gateway
    asks): requests served one at a time (no batching, so no overlap) give a prefill rate at least the prompt
    tokens over the client's own TTFT (which holds the prefill and more), and a decode rate near the client's
    own tokens per second (a batch of one: one token a step)."""
    from urllib.parse import urlencode

    from gateway.backends.backend_load import BusyRates, engine_load, metric_names

    path = "/metrics?" + urlencode([("name[]", n) for n in metric_names("vllm")])
    rates = BusyRates()
    first = httpx.get(backend.url + path, timeout=5).text
    for name in ("vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prefill_time_seconds_sum",
                 "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
                 "vllm:iteration_tokens_total_count"):
        assert f"\n{name}" in first, first  # the series the rates read, under the names the gateway asks for
    engine_load(first, "vllm", rates)
    floor, gaps, tokens = [], [], 0  # prompt tokens / client TTFT; client seconds and tokens after the first
    for i in range(3):
        prompt = _long_prompt(f"rates{i}-{time.time_ns()}")  # a fresh prompt: all of it computed
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start, stamps, usage = time.monotonic(), [], None
        with httpx.stream("POST", backend.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.monotonic())
        floor.append(usage["prompt_tokens"] / (stamps[0] - start))
        gaps.append(stamps[-1] - stamps[0])
        tokens += usage["completion_tokens"] - 1
    time.sleep(1.0)  # vLLM's logger records a finished request's histograms after its last chunk
    load = engine_load(httpx.get(backend.url + path, timeout=5).text, "vllm", rates)
    assert load.prefill_tokens_per_s >= min(floor), (load.prefill_tokens_per_s, floor)
    client_rate = tokens / sum(gaps)
    assert 0.5 * client_rate <= load.decode_tokens_per_s <= 2.0 * client_rate, (load.decode_tokens_per_s,
                                                                               client_rate)


def test_a_backend_with_another_tokenizer_is_refused(backend, caplog):
    """A gateway serving the tiny random model (its own tokenizer) in front of the SmolLM2 vLLM."""
    import logging

    from tests.support.stack import GatewayThread, gateway_config, model_dir

    with caplog.at_level(logging.ERROR, "duet.gateway.backends"):
        gw = GatewayThread(gateway_config([], backends=[backend.entry()])).start(wait_workers=0)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not caplog.records:
                time.sleep(0.2)
            assert not [v for v in gw.gateway.router.views() if v.healthy]
        finally:
            gw.stop()
    (said,) = {r.getMessage() for r in caplog.records}
    assert backend.url in said and model_dir().name in said and "pool refused" in said
    assert said.count("[") >= 2  # the backend's token list and the gateway's


def test_a_client_that_leaves_frees_vllm(gateways, backend):
    """The client hangs up mid-stream: the gateway cancels the call and vLLM stops the request."""
    from gateway.backends.backend_load import engine_load

    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", gateways["vllm"].url + "/v1/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines == 3:
                break

    def running() -> int:
        return engine_load(httpx.get(backend.url + "/metrics", timeout=5).text, "vllm").num_running

    deadline = time.monotonic() + 15
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running() == 0
