"""The shadow's configuration from the gateway config's `shadow:` section, shared through Redis so that every
replica mirrors and gates alike (gateway/control/shadow_sync.py): two gateways on one real Redis, sim workers
over real gRPC."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.config import ConfigError, from_dict
from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir

MODEL = model_dir().name
KEY = "adm-shadow"
ADMIN = {"Authorization": f"Bearer {KEY}"}
CANDIDATE = [{"engine_kind": "paged", "version": "v2"}]
ROUTING = {"variants": [{"name": "primary", "weight": 100, "pools": [{"engine_kind": "paged", "version": "v1"}]},
                        {"name": "candidate", "weight": 0, "pools": CANDIDATE}]}


def sims_to_start() -> list[Sim]:
    """The `sims` fixture's workers (tests/conftest.py): the primary's pool and the candidate's."""
    return [Sim("paged", worker_id="p1", version="v1"), Sim("paged", worker_id="p2", version="v2")]


def _shadow(gw: GatewayThread) -> dict | None:
    r = httpx.get(f"{gw.url}/admin/models/{MODEL}/shadow", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["shadow"]


def _eventually(fn, want, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_replicas_on_one_redis_share_the_configured_shadow_and_its_changes(sims, clean_redis_url):
    configured = {"pools": CANDIDATE, "share": 1.0, "max_concurrency": 2, "max_loop_lag_ms": 1000,
                  "gates": {"min_requests": 3, "max_ttft_p50_ratio": 50.0}}
    base = {"auth": {"admin_key": KEY}, "redis": clean_redis_url, "routing": ROUTING}
    one = GatewayThread(gateway_config(sims, shadow={MODEL: configured}, **base)).start()
    other = GatewayThread(gateway_config(sims, **base)).start()  # no `shadow:` of its own
    try:
        # the second replica runs the first one's configured shadow, as the store holds it
        first = _shadow(one)["config"]
        assert first["pools"] == CANDIDATE and first["share"] == 1.0 and first["max_concurrency"] == 2
        assert first["gates"]["min_requests"] == 3 and first["gates"]["max_ttft_p50_ratio"] == 50.0
        assert _shadow(other)["config"] == first

        # so it mirrors too: its own books fill with the candidate's answers
        for i in range(6):
            r = httpx.post(other.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": [5 + i, 6, 7, 8], "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-duet-worker"] == "p1", r.text
        report = _eventually(lambda: _shadow(other)["shadow"]["requests"], 6)
        assert report == 6
        # judged by the configured gates: 6 pairs are enough for their min_requests of 3 (the default is 20)
        verdict = _shadow(other)["verdict"]
        assert verdict["enough_data"] and verdict["waiting_for"] == "", verdict

        # a change made on one replica reaches the other within a poll or two
        r = httpx.put(f"{other.url}/admin/models/{MODEL}/shadow", headers=ADMIN, timeout=10,
                      json={**configured, "share": 0.25, "max_concurrency": 3})
        assert r.status_code == 200, r.text
        changed = _eventually(lambda: _shadow(one)["config"]["share"], 0.25)
        assert changed == 0.25 and _shadow(one)["config"]["max_concurrency"] == 3

        # and a stop on one stops it everywhere
        assert httpx.delete(f"{one.url}/admin/models/{MODEL}/shadow", headers=ADMIN, timeout=10).status_code == 200
        assert _eventually(lambda: _shadow(other), None) is None
    finally:
        one.stop()
        other.stop()

    # a replica that restarts takes what the store holds (none now), not its config's seed
    again = GatewayThread(gateway_config(sims, shadow={MODEL: configured}, **base)).start()
    try:
        assert _shadow(again) is None
    finally:
        again.stop()


def test_a_bad_shadow_section_is_a_config_error(sims):
    with pytest.raises(ConfigError, match=r"shadow\.m: share must be within \(0, 1\], got 2.0"):
        from_dict(gateway_config(sims, shadow={"m": {"pools": CANDIDATE, "share": 2.0}}))
    with pytest.raises(ConfigError, match=r"shadow\.m: unknown shadow field\(s\): sharee"):
        from_dict(gateway_config(sims, shadow={"m": {"pools": CANDIDATE, "sharee": 0.5}}))
