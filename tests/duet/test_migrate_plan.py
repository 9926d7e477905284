"""`duet migrate plan` answers with advise on the gateway's own capture (sim workers over real gRPC, a gateway
in this process with its capture on): the recommendation, its predicted figures, the sensitivity and the move."""

from __future__ import annotations

import httpx
import pytest

from duet.cli import main
from loadtests.advise import fleet
from loadtests.sim.fleet.bench import FleetSettings
from tests.support.stack import GatewayThread, gateway_config, model_dir

MODEL = model_dir().name
KEY = "adm-plan"


def _send(gw: GatewayThread, n: int) -> None:
    system = [5 + (i * 37) % 990 for i in range(1024)]  # one shared 1,024-token system prompt
    for i in range(n):
        r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": system + [7 + (i * 13 + k) % 990 for k in range(100)], "max_tokens": 4})
        assert r.status_code == 200, r.text


@pytest.mark.timeout(180)
def test_plan_prints_advise_on_the_gateways_capture(sims, tmp_path, capsys):
    gw = GatewayThread(gateway_config(sims, auth={"admin_key": KEY}, capture={"enabled": True})).start()
    try:
        _send(gw, 12)
        capsys.readouterr()
        assert main(["migrate", "plan", "--gateway", gw.url, "--admin-key", KEY, "--workers", "4"]) == 0
        out = capsys.readouterr().out
        capture = tmp_path / "capture.jsonl"
        assert main(["capture", "export", "--gateway", gw.url, "--admin-key", KEY, "--out", str(capture)]) == 0
        assert main(["migrate", "plan", "--gateway", gw.url, "--admin-key", KEY, "--no-advise"]) == 0
        skipped = capsys.readouterr().out
    finally:
        gw.stop()
    # the same answer advise gives on the exported capture, at the same settings
    want = fleet.advise(FleetSettings(cost_model="h200", workers=4, mix={str(capture): 1.0}, window_s=300.0))
    rec = want["recommendation"]
    assert "advice: 12 captured requests of " + MODEL + " in the fleet simulator, 4 workers, cost model h200" in out
    assert (f"advice: run {rec['deployment']} ({rec['split']['paged']} paged + {rec['split']['prefix']} prefix, "
            f"{rec['router']} router): predicted goodput") in out
    assert f"  why: {rec['why']}" in out
    assert "at half and double the traffic: traffic -> " in out
    # the capture says paged + prefix served it: the move from there, or why there is none
    canary = want["canary"]
    assert ("the move (now served by paged + prefix):" in out) == canary["needed"]
    assert out.rstrip().endswith("mirrors a share of live traffic to the recommended pool")
    assert "model " + MODEL + ": 2 workers" in skipped and "advice" not in skipped


@pytest.mark.timeout(60)
def test_plan_without_a_capture_says_why_and_goes_on(sims, capsys):
    gw = GatewayThread(gateway_config(sims, auth={"admin_key": KEY})).start()  # capture off
    try:
        assert main(["migrate", "plan", "--gateway", gw.url, "--admin-key", KEY]) == 0
    finally:
        gw.stop()
    out = capsys.readouterr().out
    assert "advice: none: the gateway's capture is off: set `capture: {enabled: true}`" in out
    assert "model " + MODEL + ": 2 workers" in out
