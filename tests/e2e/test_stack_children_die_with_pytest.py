"""tests/support/stack.py: a test process that is killed (SIGKILL: no teardown runs) takes its sim workers and
gateway processes with it, so a killed pytest run leaves nothing serving on the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

HOLDER = """
import pathlib, time
from tests.support.stack import GatewayProcess, Sim, gateway_config, start_sims
tmp = pathlib.Path({tmp!r})
sims = start_sims([Sim("prefix")], tmp)
gw = GatewayProcess(gateway_config(sims), tmp).wait_ready()
print(sims[0].proc.pid, gw.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # an unreaped zombie has exited


def test_sims_and_gateways_die_with_a_killed_test_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(tmp=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True, cwd=E2E.parents[1],
                              env=dict(os.environ, PYTHONPATH=str(E2E.parents[1])))
    pids: list[int] = []
    try:
        line = holder.stdout.readline()
        assert line, f"the holder exited with {holder.wait()} before starting its children"
        pids = [int(p) for p in line.split()]
        assert all(_alive(p) for p in pids)
        holder.kill()
        holder.wait(timeout=10)
        deadline = time.monotonic() + 30  # SIGTERM: each drains (nothing in flight) and exits
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "children outlived the killed test process"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
        for p in pids:  # only if the test failed: leave nothing behind
            if _alive(p):
                os.kill(p, signal.SIGKILL)
