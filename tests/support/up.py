"""`duet up` as a child process for the tests that run the whole stack: `Up(*flags)` starts it on a free port
(the tiny model unless `--model` is given), `wait_ready()` reads its stdout until it serves, `stop()` sends a
signal and checks that no process it started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.support import proc_tree
from tests.support.stack import ROOT, free_port, model_dir


class Up:
    def __init__(self, *flags: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the tiny model unless a test says otherwise (the default real model is tested in tests/realmodel)
        if "--model" not in flags:
            flags = ("--model", str(model_dir()), *flags)
        self.proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "up", "--port", str(self.port), *flags],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**{k: v for k, v in os.environ.items() if k != "DUET_ADMIN_KEY"},
                                          **(env or {})})
        self.out: list[str] = []

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.out.append(line)
            if line.startswith("Ctrl-C to stop"):
                return
        raise AssertionError("duet up did not get ready:\n" + "".join(self.out))

    def stop(self, sig=signal.SIGINT) -> int:
        descendants = proc_tree.descendants(self.proc.pid)
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        assert _wait_gone(descendants), f"orphans left: {[p for p in descendants if proc_tree.alive(p)]}"
        return code


def _wait_gone(pids: set[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(proc_tree.alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False
