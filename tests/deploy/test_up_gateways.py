"""`duet up --gateways 2` end to end: two gateway processes behind `duet lb` on one port, sharing a
private redis-server that `duet up` starts; one gateway is killed (SIGKILL) in the middle of a load run.

What a user must see: no request that had not started streaming is lost, the run goes on through the
surviving gateway, and every session stays on its worker whichever gateway served it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.stack import ROOT, free_port, model_dir

RUN_S = 5.0
KILL_AT_S = 1.5
CLIENTS = 6


@dataclass
class Outcome:
    session: int
    t_start: float
    started: bool = False  # a 200 and the first SSE event arrived
    done: bool = False  # the stream ended with [DONE]
    worker: str | None = None
    error: str | None = None


def _pid_of(cmdline_part: str) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if cmdline_part in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    return int(d.name)
            except OSError:
                continue
    return None


@pytest.fixture
def up_two_gateways(redis_binary):
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(redis_binary).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "up", "--model", str(model_dir()),
                             "--sim", "--sim-ms-per-token", "20",
                             "--paged", "1", "--prefix", "2", "--gateways", "2", "--port", str(port),
                             "--ready-timeout", "90"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C") or time.monotonic() > deadline:
            break
    out = "".join(lines)
    assert "Ctrl-C" in out, out
    assert "2 gateways behind duet lb" in out
    log_dir = re.search(r"logs in (\S+)", out).group(1)
    yield f"http://127.0.0.1:{port}", Path(log_dir)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, proc.stdout.read()[-3000:]


async def _client(url: str, session: int, t0: float, outcomes: list[Outcome]) -> None:
    # a fresh connection per request and no SDK retries: a lost request shows as an error here
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=20) as client:
        turn = 0
        while time.monotonic() - t0 < RUN_S:
            o = Outcome(session, time.monotonic() - t0)
            outcomes.append(o)
            body = {"model": model_dir().name, "stream": True, "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"session {session} turn {turn}"}]}
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                         headers={"x-session-id": f"s{session}"}) as r:
                    if r.status_code != 200:
                        o.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                        continue
                    o.worker = r.headers["x-duet-worker"]
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            o.started = True
                            o.done = line == "data: [DONE]"
            except httpx.HTTPError as e:
                o.error = f"{type(e).__name__}: {e}"
            turn += 1


async def test_one_gateway_killed_mid_run(up_two_gateways):
    url, log_dir = up_two_gateways
    victim = _pid_of(str(log_dir / "gateway-0.yaml"))
    assert victim is not None, "gateway-0 not found"
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    clients = [asyncio.create_task(_client(url, s, t0, outcomes)) for s in range(CLIENTS)]
    await asyncio.sleep(KILL_AT_S)
    os.kill(victim, signal.SIGKILL)
    await asyncio.gather(*clients)

    lost = [o for o in outcomes if not o.done and not o.started]
    cut = [o for o in outcomes if o.started and not o.done]
    after = [o for o in outcomes if o.t_start > KILL_AT_S + 0.5]
    assert len(outcomes) > 2 * CLIENTS, f"too few requests to show anything: {len(outcomes)}"
    assert not lost, f"requests lost before streaming: {[o.error for o in lost]}"
    assert len(cut) <= CLIENTS, "only streams already running on the killed gateway may break"
    assert after and all(o.done for o in after), "the run did not go on through the surviving gateway"
    for s in range(CLIENTS):
        workers = {o.worker for o in outcomes if o.session == s and o.done}
        assert len(workers) == 1, f"session s{s} moved between workers: {workers}"
    victim_port = yaml.safe_load((log_dir / "gateway-0.yaml").read_text())["port"]
    lb_log = (log_dir / "lb.log").read_text()
    # the balancer noticed (after the replica first came up); `duet up`'s supervisor may restart it after
    since_up = lb_log[lb_log.index(f"127.0.0.1:{victim_port} is up"):]
    assert re.search(rf"127\.0\.0\.1:{victim_port} .*down", since_up), lb_log[-2000:]


def test_several_gateways_without_redis_say_what_is_missing():
    env = {**os.environ, "PATH": "/nonexistent"}  # no redis-server to start
    out = subprocess.run([sys.executable, "-m", "duet.cli", "up", "--model", str(model_dir()), "--sim",
                          "--gateways", "2",
                          "--port", str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2
    assert "--redis URL" in out.stderr and "redis-server" in out.stderr
