"""Real engine workers register themselves in Redis: a `duet engine paged --redis URL` process is found by
a gateway that has no static workers, answers a request through it, and leaves the registry as soon as
it drains (not a TTL later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import redis

from duet.registry import worker_key
from tests.support.stack import ROOT, GatewayThread, free_port, gateway_config, model_dir


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(180)
def test_paged_worker_with_redis_is_discovered_serves_and_deregisters_on_drain(tmp_path, clean_redis_url):
    port = free_port()
    address = f"127.0.0.1:{port}"
    gw = GatewayThread(gateway_config([], redis=clean_redis_url)).start(wait_workers=0)
    with open(tmp_path / "paged.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "duet.cli", "engine", "paged", "--model", str(model_dir()), "--port", str(port),
             "--device", "cpu", "--kv-cache-tokens", "2048", "--worker-id", "paged-r", "--version", "v7",
             "--redis", clean_redis_url],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    r = redis.Redis.from_url(clean_redis_url)
    try:
        found = _wait(lambda: any(v.healthy for v in gw.gateway.router.views()) or proc.poll() is not None, 120)
        assert found and proc.poll() is None, (tmp_path / "paged.log").read_text()[-3000:]
        (view,) = gw.gateway.router.views()
        assert (view.worker_id, view.engine_kind, view.version) == ("paged-r", "paged", "v7")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        raw = client.completions.with_raw_response.create(model=model_dir().name, prompt="hello", max_tokens=3,
                                                        temperature=0, extra_body={"ignore_eos": True})
        assert raw.headers["x-duet-worker"] == "paged-r" and raw.headers["x-duet-engine"] == "paged"
        assert raw.parse().usage.completion_tokens == 3
        assert r.exists(worker_key("paged-r"))
        assert gw.gateway.fleet.get("paged-r").address == address

        proc.send_signal(signal.SIGTERM)  # drain: the entry goes at once, well before its 5 s TTL
        assert proc.wait(timeout=30) == 0
        assert not r.exists(worker_key("paged-r"))
        assert _wait(lambda: not gw.gateway.router.views(), 3), "the drained worker is still in the gateway's pool"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        r.close()
        gw.stop()
