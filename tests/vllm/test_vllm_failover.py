"""vLLM as the paged pool beside a Duet prefix worker (gateways["mixed"]): requests split by what they
need, and a vLLM killed mid-stream is a clean error event, its breaker opens, new requests go to the
Duet worker, and vLLM serves again once it is back. Runs last in the tier (it restarts the server)."""

from __future__ import annotations

import time

import openai
import pytest

MODEL = "smollm2-135m-instruct"
# the first test of the tier also installs vLLM (minutes, once) and starts it
pytestmark = pytest.mark.timeout(1800)


def _client(gateways) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateways["mixed"].url + "/v1", api_key="k", max_retries=0, timeout=300)


def test_requests_split_between_vllm_and_the_duet_worker(gateways, backend):
    c = _client(gateways)
    # n>1 is a paged capability (Duet's prefix engine has no "n"): vLLM
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2, n=2, temperature=1.0)
    assert raw.headers["x-duet-worker"] == backend.url
    # structured output is the prefix engine's: Duet's worker
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes"}], max_tokens=8, temperature=0,
        response_format={"type": "json_object"})
    assert raw.headers["x-duet-engine"] == "prefix" and raw.headers["x-duet-worker"] != backend.url


def test_vllm_killed_mid_stream(gateways, backend):
    c = _client(gateways)
    gw = gateways["mixed"].gateway
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=2000,
                                                 temperature=0, n=2, stream=True, extra_body={"ignore_eos": True})
    assert raw.headers["x-duet-worker"] == backend.url
    got = 0
    with pytest.raises(openai.APIError) as err:  # an error event, never a silent truncation
        for _ in raw.parse():
            got += 1
            if got == 3:
                backend.kill()
    assert "mid-stream" in str(err.value.message)
    assert backend.url in gw.breakers.open_workers()
    for i in range(3):  # the other pool serves meanwhile
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"q{i}", max_tokens=2, temperature=0)
        assert raw.headers["x-duet-worker"] != backend.url
        assert raw.parse().choices[0].finish_reason == "length"

    backend.start()  # same port, same events port
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(v.worker_id == backend.url and v.healthy for v in gw.router.views()):
        time.sleep(0.5)
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hello again", max_tokens=2, n=2)
    assert raw.headers["x-duet-worker"] == backend.url
    assert len(raw.parse().choices) == 2
