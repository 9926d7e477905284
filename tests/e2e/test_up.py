"""`duet up` end to end: the whole stack as child processes, the openai SDK against it, clean shutdown."""

from __future__ import annotations

import json
import re
import signal
import time

import grpc
import httpx
import openai
import pytest

from duet.launcher import listening
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from tests.support import proc_tree
from tests.support.stack import model_dir
from tests.support.up import Up

MODEL = model_dir().name


def test_duet_up_with_sim_workers_serves_and_ctrl_c_leaves_no_orphans():
    up = Up("--sim", "--paged", "1", "--prefix", "2", "--sim-ms-per-token", "2")
    try:
        up.wait_ready(60)
        text = "".join(up.out)
        assert f"API:       {up.url}/v1" in text and f"{up.url}/dashboard" in text
        assert "Worker metrics:" not in text  # sims export no metrics of their own
        # the URLs come only once every worker started is healthy, not as soon as one is
        assert httpx.get(up.url + "/ready").json()["healthy_workers"] == {MODEL: 3}
        # no key given: `duet up` made one and printed it next to the dashboard URL; it opens the admin API
        key = re.search(r"/dashboard  \(admin key: (\S+)\)", text).group(1)
        assert httpx.get(up.url + "/admin/workers").status_code in (401, 403)
        workers = httpx.get(up.url + "/admin/workers", headers={"Authorization": f"Bearer {key}"})
        assert workers.status_code == 200 and len(workers.json()["workers"]) == 3
        assert len(proc_tree.descendants(up.proc.pid)) >= 4  # 3 workers + the gateway
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        # `duet up` captures the traffic's shape by default: that request is one Mooncake record
        captured = httpx.get(up.url + "/admin/capture", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert [json.loads(line)["output_length"] for line in captured.text.splitlines()] == [3]
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0


def _load(address: str) -> pb.EngineLoad:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.EngineStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)


@pytest.mark.timeout(300)
def test_duet_up_real_engines_answer_the_sdk_and_a_disconnect_returns_pages():
    up = Up("--device", "cpu", env={"DUET_ADMIN_KEY": "adm"})
    try:
        up.wait_ready(240)
        # each engine worker's own metrics, on the port `duet up` printed for it
        (line,) = [ln for ln in up.out if ln.startswith("Worker metrics:")]
        urls = dict(re.findall(r"(\S+) (http://127\.0\.0\.1:\d+/metrics)", line))
        assert sorted(urls) == ["paged-0", "prefix-0"], line
        for url in urls.values():
            assert "duet_kv_cache_usage_perc" in httpx.get(url, timeout=10).text
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="k", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0)
        r = raw.parse()
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        assert raw.headers["x-duet-engine"] in ("paged", "prefix")
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens >= 1
        workers = httpx.get(up.url + "/admin/workers", headers={"Authorization": "Bearer adm"}).json()["workers"]
        paged = next(w for w in workers if w["engine_kind"] == "paged")
        assert _load(paged["address"]).kv_pages_used == 0
        # n=2 goes to the paged engine; disconnect mid-stream and its pages come back
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count slowly"}], "max_tokens": 1500,
                "n": 2, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", up.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.headers["x-duet-worker"] == paged["worker_id"]
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            assert _load(paged["address"]).kv_pages_used > 0
        assert _wait(lambda: _load(paged["address"]).kv_pages_used == 0), "pages not returned after disconnect"
        assert _load(paged["address"]).num_running == 0
    finally:
        code = up.stop(signal.SIGTERM)
    assert code == 0


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_duet_up_opens_the_api_once_a_worker_of_each_kind_is_ready_and_says_what_it_waits_for():
    """Sim workers that load for 4 s (NOT_SERVING, as an engine loading its model): while they load, stdout says
    so and nothing listens on the API port; then each is ready, the API opens, and the model it lists answers."""
    up = Up("--sim", "--paged", "1", "--prefix", "1", "--sim-ms-per-token", "2", "--sim-load-s", "4")
    try:
        closed_while_loading = []
        while not (line := up.proc.stdout.readline()).startswith("Ctrl-C to stop"):
            assert line or up.proc.poll() is None, "".join(up.out)
            up.out.append(line)
            if line.startswith("duet up: waiting for") and "loading" in line:
                closed_while_loading.append(not listening(up.port))
        said = [ln.strip() for ln in up.out if ln.startswith("duet up: ")][1:]  # after the one-line summary
        for worker, kind in (("paged-0", "paged"), ("prefix-0", "prefix")):
            assert f"duet up: waiting for {worker} (sim as {kind}: loading {MODEL})" in said, said
            ready = next(ln for ln in said if ln.startswith(f"duet up: ready: {worker} (sim as {kind}) after "))
            assert float(ready.split(" after ")[1].removesuffix(" s")) >= 4.0
        assert said[-1] == "duet up: opening the API" and len(closed_while_loading) == 2, said
        assert all(closed_while_loading)  # no API while the workers load
        models = [m["id"] for m in httpx.get(up.url + "/v1/models").json()["data"]]
        assert models == [MODEL]
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model=models[0], messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
        assert r.choices[0].finish_reason == "length"
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0
