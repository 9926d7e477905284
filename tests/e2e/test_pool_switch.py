"""`duet up --workers N`: the pool planner moves workers between engine kinds as the traffic shifts
(documents-heavy, then sessions-heavy), and no request is lost while workers drain and restart."""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import httpx
import pytest

from tests.support.stack import model_dir
from tests.support.up import Up

MODEL = model_dir().name

KEY = "pool-switch-key"
PLANNER = {"window_s": 3.0, "cooldown_s": 2.0, "hysteresis": 0.5}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
         "nu", "xi", "omicron", "pi", "rho", "sigma"]


class Load:
    """Closed-loop clients in threads; every answer is checked (200, the full max_tokens, `length`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent = self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.starts = 0

    def start(self, kind: str, clients: int, pause_s: float = 0.0) -> None:
        # each start seeds its clients apart: a document client of the second phase seeded like the first
        # phase's would resend the same documents, which the router then sees as reused (prefix), so the
        # paged pool had no work and the planner rightly gave it no worker
        self.starts += 1
        for i in range(clients):
            t = threading.Thread(target=self._loop, args=(kind, i, pause_s, self.starts), daemon=True)
            t.start()
            self.threads.append(t)

    def _loop(self, kind: str, i: int, pause_s: float, start: int) -> None:
        rng = random.Random(f"{kind}-{i}-{start}")
        history: list[dict] = []
        with httpx.Client(base_url=self.url, timeout=60) as c:
            n = 0
            while not self.stop.wait(pause_s):
                n += 1
                headers = {}
                if kind == "document":  # a one-shot long prompt, never seen before
                    messages = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=400))}]
                    max_tokens = 2
                else:  # a conversation: short turns, longer answers, a session key
                    if len(history) > 12:
                        history = []
                    history.append({"role": "user", "content": f"turn {n}: " + " ".join(rng.choices(WORDS, k=8))})
                    messages, max_tokens = list(history), 24
                    headers["x-session-id"] = f"s-{i}-{n // 7}"
                with self.lock:
                    self.sent += 1
                try:
                    r = c.post("/v1/chat/completions", headers=headers,
                               json={"model": MODEL, "messages": messages, "max_tokens": max_tokens})
                    body = r.json()
                    good = (r.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
                            and body["usage"]["completion_tokens"] == max_tokens)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    good, body = False, repr(e)
                with self.lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failures.append(str(body)[:300])
                if kind != "document" and good:
                    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
        self.threads = []
        self.stop = threading.Event()


def kinds(url: str) -> dict[str, int]:
    rows = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()["workers"]
    serving = [w for w in rows if w["healthy"] and not w["draining"]]
    return {k: sum(1 for w in serving if w["engine_kind"] == k) for k in ("paged", "prefix")}


def wait_for_split(url: str, want: dict[str, int], timeout_s: float) -> list[dict]:
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pools = httpx.get(url + "/admin/pools", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()
        now = kinds(url)
        seen.append({"target": pools["target"], "serving": now, "work": pools["work"]})
        if pools["target"] == want and now == want:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"split never reached {want}; last observations: {json.dumps(seen[-5:])}")


@pytest.mark.timeout(400)
def test_the_planner_switches_kinds_under_a_shifting_load_and_loses_no_request():
    up = Up("--sim", "--workers", "4", "--sim-ms-per-token", "3", "--pool-planner", json.dumps(PLANNER),
            env={"DUET_ADMIN_KEY": KEY})
    load = Load(up.url)
    try:
        up.wait_ready(90)
        assert kinds(up.url) == {"paged": 2, "prefix": 2}  # --workers 4 starts half of each
        # documents-heavy (a trickle of sessions keeps prefix busy): paged grows to 3
        load.start("document", 4)
        load.start("session", 1)
        wait_for_split(up.url, {"paged": 3, "prefix": 1}, 120)
        load.finish()
        # sessions-heavy (a trickle of documents): prefix grows to 3
        load.start("session", 5)
        load.start("document", 1, pause_s=1.0)
        wait_for_split(up.url, {"paged": 1, "prefix": 3}, 150)
        time.sleep(2)  # traffic keeps flowing over the settled split
        load.finish()
    finally:
        load.finish()
        code = up.stop(signal.SIGINT)
    assert not load.failures, f"{len(load.failures)} of {load.sent} requests failed: {load.failures[:3]}"
    assert load.ok == load.sent and load.sent > 50
    assert code == 0


@pytest.mark.timeout(400)
def test_the_planner_settles_on_one_kind_and_brings_the_other_back_for_a_capability_only_it_has():
    up = Up("--sim", "--workers", "2", "--sim-ms-per-token", "3", "--pool-planner", json.dumps(PLANNER),
            env={"DUET_ADMIN_KEY": KEY})
    load = Load(up.url)
    try:
        up.wait_ready(90)
        assert kinds(up.url) == {"paged": 1, "prefix": 1}
        # sessions only: nothing wants engine_paged, so a homogeneous fleet is the split
        load.start("session", 3)
        wait_for_split(up.url, {"paged": 0, "prefix": 2}, 120)
        # n = 2 only engine_paged serves: refused with a 503 that says so, until the planner, seeing these
        # requests arrive, brings a paged worker back; then they are served
        refusals, served, deadline = [], None, time.monotonic() + 120
        with httpx.Client(base_url=up.url, timeout=60) as c:
            while served is None and time.monotonic() < deadline:
                r = c.post("/v1/chat/completions", json={"model": MODEL, "n": 2, "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "two answers"}]})
                if r.status_code == 200:
                    served = r.json()
                else:
                    refusals.append((r.status_code, r.json()["error"]["message"]))
                    time.sleep(0.5)
        assert served is not None and len(served["choices"]) == 2, refusals[-3:]
        assert refusals and all(code == 503 and "engine_paged serves it" in msg for code, msg in refusals)
        assert kinds(up.url)["paged"] == 1
        load.finish()
    finally:
        load.finish()
        code = up.stop(signal.SIGINT)
    assert not load.failures, f"{len(load.failures)} of {load.sent} requests failed: {load.failures[:3]}"
    assert load.ok == load.sent and load.sent > 20
    assert code == 0
