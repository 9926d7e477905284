"""A backend that does not answer at start (gateway/backends/http_backend.py): one clear log line naming it, and
the gateway serves with the pools it has (a real sim worker here)."""

from __future__ import annotations

import logging

import openai

from tests.support.stack import GatewayThread, Sim, free_port, gateway_config, model_dir, start_sims

MODEL = model_dir().name


def test_an_unreachable_backend_is_named_and_the_other_pool_serves(tmp_path, caplog):
    sims = start_sims([Sim("prefix")], tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, "duet.gateway.backends"):
        gw = GatewayThread(gateway_config(sims, backends=[{"engine": "vllm", "url": dead}])).start(wait_workers=1)
        try:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
            for i in range(3):
                raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}", max_tokens=2)
                assert raw.headers["x-duet-worker"] == sims[0].address
            rows = {r["worker_id"]: r for r in gw.gateway.admin.worker_rows()}
            assert rows[dead]["healthy"] is False
        finally:
            gw.stop()
            for s in sims:
                s.kill()
    said = [r.getMessage() for r in caplog.records if dead in r.getMessage()]
    assert len(said) == 1 and "unreachable" in said[0]  # once, not once per poll
