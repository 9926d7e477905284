"""Per-API-key limits shared by two gateway replicas through one real Redis (gateway/control/limits.py):
requests/min, tokens/min, concurrent requests, allowed models; 429s carry Retry-After and the OpenAI
error shape the SDK raises as RateLimitError; a Redis outage falls back to per-replica limits."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.support.stack import GatewayThread, gateway_config, model_dir

MODEL = model_dir().name
KEYS = [
    {"key": "sk-rpm", "requests_per_minute": 3},
    {"key": "sk-tpm", "tokens_per_minute": 200},
    {"key": "sk-conc", "max_concurrent": 1},
    {"key": "sk-models", "models": ["some-other-model"]},
    "sk-free",
]


@pytest.fixture
def gateways(sims, clean_redis_url):
    gws = [GatewayThread(gateway_config(sims, redis=clean_redis_url, auth={"api_keys": KEYS})).start()
           for _ in range(2)]
    # mid-window on a frozen clock: a minute boundary during the test cannot reset the counts
    frozen = (time.time() // 60) * 60 + 30
    for g in gws:
        g.gateway.limiter.clock = lambda: frozen
    yield gws
    for g in gws:
        g.stop()


def _client(gw, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def _complete(gw, key: str, **kw):
    return _client(gw, key).completions.create(model=MODEL, prompt="hello", max_tokens=kw.pop("max_tokens", 2), **kw)


def test_requests_per_minute_is_shared_by_the_replicas(gateways):
    a, b = gateways
    _complete(a, "sk-rpm")
    _complete(b, "sk-rpm")
    _complete(a, "sk-rpm")
    with pytest.raises(openai.RateLimitError) as e:
        _complete(b, "sk-rpm")
    assert e.value.body["type"] == "rate_limit_exceeded" and "3 requests per minute" in e.value.body["message"]
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 30  # the frozen clock is mid-window
    _complete(b, "sk-free")  # other keys are not affected


def test_tokens_per_minute_counts_prompt_plus_max_tokens(gateways):
    a, b = gateways
    _complete(a, "sk-tpm", max_tokens=150)
    with pytest.raises(openai.RateLimitError) as e:
        _complete(b, "sk-tpm", max_tokens=150)
    assert "200 tokens per minute" in e.value.body["message"]
    _complete(b, "sk-tpm", max_tokens=10)  # still fits


def test_concurrent_requests_across_replicas_and_the_slot_comes_back(gateways):
    a, b = gateways
    body = {"model": MODEL, "prompt": "long", "max_tokens": 100, "ignore_eos": True, "stream": True}
    auth = {"Authorization": "Bearer sk-conc"}
    started, done = threading.Event(), threading.Event()

    def long_stream():
        with httpx.stream("POST", a.url + "/v1/completions", json=body, headers=auth, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
        done.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(10)
    r = httpx.post(b.url + "/v1/completions", json={**body, "stream": False}, headers=auth, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "1 concurrent requests" in r.json()["error"]["message"] and r.headers["x-request-id"]
    t.join(30)
    assert done.is_set()
    r = httpx.post(b.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=auth,
                   timeout=30)
    assert r.status_code == 200, r.text


def test_a_key_limited_to_other_models_gets_404(gateways):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(gateways[0], "sk-models")
    assert e.value.body["code"] == "model_not_found"


def test_requests_per_minute_without_redis_are_enforced_per_process(sims):
    g = GatewayThread(gateway_config(sims, auth={"api_keys": [{"key": "k", "requests_per_minute": 1}]})).start()
    try:
        frozen = (time.time() // 60) * 60 + 30
        g.gateway.limiter.clock = lambda: frozen
        _complete(g, "k")
        with pytest.raises(openai.RateLimitError):
            _complete(g, "k")
    finally:
        g.stop()


def test_a_redis_outage_falls_back_to_per_replica_limits(sims, private_redis):
    g = GatewayThread(gateway_config(sims, redis=private_redis.url,
                                     auth={"api_keys": [{"key": "k", "requests_per_minute": 2}]})).start()
    try:
        frozen = (time.time() // 60) * 60 + 30
        g.gateway.limiter.clock = lambda: frozen
        _complete(g, "k")
        private_redis.stop()
        _complete(g, "k")  # served: an outage never fails a request
        assert g.gateway.limiter.redis_down
        _complete(g, "k")
        with pytest.raises(openai.RateLimitError):  # the local counters saw 2 during the outage
            _complete(g, "k")
    finally:
        g.stop()


def test_key_limits_config_defaults_overrides_and_bad_values():
    from gateway.config import ConfigError, from_dict
    from gateway.control.limits import KeyLimits, api_key_id

    cfg = from_dict({"auth": {"default_key_limits": {"requests_per_minute": 10, "models": ["m"]},
                              "api_keys": ["sk-a", {"key": "sk-b", "cache_salt": "b", "requests_per_minute": 99,
                                                    "max_concurrent": 2}]}})
    assert cfg.key_limits[api_key_id("sk-a")] == KeyLimits(requests_per_minute=10, models=("m",))
    assert cfg.key_limits[api_key_id("sk-b")] == KeyLimits(requests_per_minute=99, max_concurrent=2, models=("m",))
    assert cfg.api_keys == {"sk-a": "", "sk-b": "b"}
    banded = from_dict({"auth": {"default_key_limits": {"band": "sheddable"},
                                 "api_keys": ["sk-a", {"key": "sk-b", "band": "critical"}]}})
    assert [banded.key_limits[api_key_id(k)].band for k in ("sk-a", "sk-b")] == ["sheddable", "critical"]
    with pytest.raises(ConfigError, match="band must be one of critical, standard, sheddable"):
        from_dict({"auth": {"api_keys": [{"key": "k", "band": "gold"}]}})
    with pytest.raises(ConfigError, match="requests_per_minute must be a positive integer"):
        from_dict({"auth": {"api_keys": [{"key": "k", "requests_per_minute": 0}]}})
    with pytest.raises(ConfigError, match="stall_s must be > 0"):
        from_dict({"timeouts": {"stall_s": -1}})
    with pytest.raises(ConfigError, match="unknown keys"):
        from_dict({"timeouts": {"stal_s": 1}})
