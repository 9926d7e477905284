"""Every wait on an engine ends (issue 14), against real sim worker processes over gRPC:

- a worker frozen (SIGSTOP) mid-stream: its streams end with an error event after the stall timeout,
  streams on the other worker finish, and once the worker thaws the cancelled requests free their pages;
- a worker too slow to produce a first token: the request is retried on another worker;
- a worker that fails every call: its circuit breaker opens and requests stop trying it first."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.support.stack import GatewayThread, Sim, gateway_config, model_dir, start_sims

MODEL = model_dir().name
FAST_TIMEOUTS = {"stall_s": 1.5, "first_token_s": 1.5, "breaker_failures": 2, "breaker_open_s": 60}


def _stream(url: str, out: dict, i: int) -> None:
    body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    # Duet's routing sends a session to engine_prefix and a one-shot prompt to engine_paged: both workers stream
    headers = {"x-session-id": f"session-{i}"} if i % 2 else {}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        rec = out[i] = {"worker": r.headers.get("x-duet-worker"), "events": [], "t_end": None}
        for line in r.iter_lines():
            if line.startswith("data: "):
                rec["events"].append(line[6:])
        rec["t_end"] = time.monotonic()


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_a_frozen_worker_s_streams_end_after_the_stall_timeout_and_free_their_pages(tmp_path):
    sims = start_sims([Sim("paged", worker_id="frozen", ms_per_token=20), Sim("prefix", worker_id="ok",
                                                                               ms_per_token=20)], tmp_path)
    gw = GatewayThread(gateway_config(sims, timeouts=FAST_TIMEOUTS)).start()
    frozen = sims[0]
    try:
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(gw.url, out, i)) for i in range(6)]
        for t in threads:
            t.start()
        assert _wait(lambda: len(out) == 6 and all(len(o["events"]) >= 2 for o in out.values()), 20), out
        assert {o["worker"] for o in out.values()} == {"frozen", "ok"}
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            for t in threads:
                t.join(timeout=30)
            for o in out.values():
                assert o["events"][-1] == "[DONE]"
                last = json.loads(o["events"][-2])
                if o["worker"] == "frozen":
                    assert last["error"]["type"] == "engine_error" and "stalled" in last["error"]["message"]
                    # 1.5 s stall + a watchdog tick, with a wide margin for a loaded machine
                    assert o["t_end"] - t_stop < 8.0
                else:
                    assert last["choices"][0]["finish_reason"] == "length"
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        metrics = httpx.get(gw.url + "/metrics").text
        assert re.search(r'duet_stream_timeouts_total\{worker="frozen"\} [1-9]', metrics), metrics
        # thawed: the cancelled requests are aborted and their pages come back
        assert _wait(lambda: frozen.load().num_running == 0 and frozen.load().kv_pages_used == 0, 15)
    finally:
        gw.stop()
        for s in sims:
            s.kill()


@pytest.mark.timeout(120)
def test_no_first_token_in_time_is_retried_on_another_worker(tmp_path):
    # the paged sim (where a fresh prompt goes first) takes 1 s per prompt token to prefill
    sims = start_sims([Sim("paged", worker_id="slow", prefill_ms_per_token=1000.0), Sim("prefix", worker_id="fast")],
                      tmp_path)
    gw = GatewayThread(gateway_config(sims, timeouts=FAST_TIMEOUTS)).start()
    try:
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "a prompt of several tokens",
                                                         "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.headers["x-duet-worker"] == "fast", r.text
        assert time.monotonic() - t0 < 10
        metrics = httpx.get(gw.url + "/metrics").text
        assert re.search(r'duet_worker_retries_total\{worker="slow"\} 1\.0', metrics), metrics
        assert _wait(lambda: sims[0].load().num_running == 0, 15)  # the slow attempt was cancelled
        # the timeout left the slow worker out of routing until its next good health check: wait for that
        # (racing it answered "no healthy worker" instead, when the poll came late)
        assert _wait(lambda: any(v.worker_id == "slow" and v.healthy for v in gw.gateway.fleet.views()), 15)
        # alone, the slow worker gets a clear 503 naming the timeout instead of a hang
        gw.gateway.fleet.drained.add("fast")
        r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "another slow prompt here",
                                                         "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "no first token" in r.json()["error"]["message"], r.text
    finally:
        gw.stop()
        for s in sims:
            s.kill()


@pytest.mark.timeout(120)
def test_a_worker_failing_every_call_is_left_out_by_its_breaker(tmp_path):
    sims = start_sims([Sim("paged", worker_id="bad", fail_rate=1.0), Sim("prefix", worker_id="good")], tmp_path)
    gw = GatewayThread(gateway_config(sims, timeouts=FAST_TIMEOUTS)).start()
    try:
        def retries_of_bad() -> float:
            m = re.search(r'duet_worker_retries_total\{worker="bad"\} ([0-9.]+)', httpx.get(gw.url + "/metrics").text)
            return float(m.group(1)) if m else 0.0

        for i in range(12):
            r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200 and r.headers["x-duet-worker"] == "good"
            if retries_of_bad() >= 2:
                break
            time.sleep(0.3)  # let a health poll mark the bad worker healthy again
        assert gw.gateway.breakers.state("bad") == "open"
        assert 'duet_worker_breaker_opened_total{worker="bad"} 1.0' in httpx.get(gw.url + "/metrics").text
        time.sleep(1.0)  # health polls say "bad" is healthy; the open breaker still keeps it out
        before = retries_of_bad()
        for i in range(5):
            r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": f"q{i}", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200
        assert retries_of_bad() == before == 2.0
    finally:
        gw.stop()
        for s in sims:
            s.kill()


@pytest.mark.timeout(120)
def test_with_every_breaker_open_a_request_waits_for_the_half_open_probe_within_its_timeout(tmp_path):
    sims = start_sims([Sim("paged", worker_id="a"), Sim("prefix", worker_id="b")], tmp_path)
    gw = GatewayThread(gateway_config(sims, timeouts={**FAST_TIMEOUTS, "breaker_open_s": 1.5})).start()

    def open_all() -> None:
        for w in ("a", "b"):
            for _ in range(FAST_TIMEOUTS["breaker_failures"]):
                gw.gateway.breakers.record_failure(w)
        assert sorted(gw.gateway.breakers.open_workers()) == ["a", "b"]

    body = {"model": MODEL, "prompt": "wait for me", "max_tokens": 2}
    try:
        open_all()
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text  # served by the probe, not refused at once
        assert 1.0 < time.monotonic() - t0 < 10
        # a client whose timeout ends before any breaker turns half-open is told at once
        open_all()
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/v1/completions", json=body, headers={"x-stainless-read-timeout": "0.5"},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capable_worker", r.text
        assert time.monotonic() - t0 < 1.4  # before the breakers' 1.5 s are up: it did not wait
    finally:
        gw.stop()
        for s in sims:
            s.kill()
