"""`duet up` survives a worker's death (issue 14): kill -9 one of two workers while both stream; the
dead worker's streams end with an error event and [DONE], the healthy worker's streams finish
untouched, the gateway keeps answering, and the worker is restarted and serves again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support import proc_tree
from tests.support.stack import model_dir
from tests.support.up import Up

MODEL = model_dir().name
ADMIN = {"Authorization": "Bearer adm"}


def _stream(url: str, out: dict, i: int) -> None:
    body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 150, "ignore_eos": True, "stream": True}
    # Duet's routing sends a session to engine_prefix and a one-shot prompt to engine_paged: both workers stream
    headers = {"x-session-id": f"session-{i}"} if i % 2 else {}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            out[i] = {"worker": r.headers.get("x-duet-worker"), "events": events}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as e:
        out[i] = {"worker": None, "events": events, "transport_error": repr(e)}


def _worker_pid(up: Up, worker_id: str) -> int:
    for pid in proc_tree.descendants(up.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker-id" in cmd and cmd[cmd.index(b"--worker-id") + 1] == worker_id.encode():
            return pid
    raise AssertionError(f"no process for {worker_id}")


@pytest.mark.timeout(180)
def test_kill_9_of_one_worker_cuts_only_its_streams_and_it_comes_back():
    up = Up("--sim", "--paged", "1", "--prefix", "1", "--sim-ms-per-token", "20", env={"DUET_ADMIN_KEY": "adm"})
    try:
        up.wait_ready(60)
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(up.url, out, i)) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while not (len(out) == 8 and all(len(o["events"]) >= 2 for o in out.values())):
            assert time.monotonic() < deadline, out
            time.sleep(0.05)
        workers = {o["worker"] for o in out.values()}
        assert workers == {"paged-0", "prefix-0"}, workers
        victim = _worker_pid(up, "prefix-0")
        os.kill(victim, signal.SIGKILL)
        # the gateway keeps answering while the worker is down
        during = httpx.post(up.url + "/v1/completions", json={"model": MODEL, "prompt": "meanwhile",
                                                                "max_tokens": 2}, timeout=30)
        assert during.status_code == 200, during.text
        for t in threads:
            t.join(timeout=60)
        for o in out.values():
            assert "transport_error" not in o and o["events"][-1] == "[DONE]", o
            payloads = [json.loads(e) for e in o["events"][:-1]]
            if o["worker"] == "prefix-0":
                assert "error" in payloads[-1] and payloads[-1]["error"]["type"] == "engine_error"
            else:  # untouched: all 150 tokens, a finish reason, no error
                assert not any("error" in p for p in payloads)
                assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        # restarted by the supervisor, under the same name and port, and serving again
        deadline = time.monotonic() + 30
        while True:
            rows = httpx.get(up.url + "/admin/workers", headers=ADMIN).json()["workers"]
            if all(w["healthy"] for w in rows) and _worker_pid(up, "prefix-0") != victim:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        # a session (engine_prefix) and a one-shot prompt (engine_paged) each, as the streams were sent
        served = {httpx.post(up.url + "/v1/completions", json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 2},
                             headers={"x-session-id": f"after-{i}"} if i % 2 else {},
                             timeout=30).headers["x-duet-worker"]
                  for i in range(4)}
        assert served == {"paged-0", "prefix-0"}
        assert up.proc.poll() is None
    finally:
        up.stop(signal.SIGTERM)
