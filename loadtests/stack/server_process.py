"""One server process the benchmarks start beside Duet (a vLLM server, a peer router, a gateway), written once.

`ServerProcess(name, argv, port, log_path, env=...)` is a context manager: the process in a session of its own,
its output in a file, ready once one of `ready_paths` answers 200 (PeerError with the log's tail if it exits
first or is not ready in time); on exit SIGTERM to its whole process group (a server's own children too),
SIGKILL to whatever is left after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self


class PeerError(RuntimeError):
    """A peer could not be installed or did not come up; the message says where its log is."""


class ServerProcess:
    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, *, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 120.0, ready_paths: tuple[str, ...] = ("/v1/models", "/health"),
                 grace_s: float = 10.0) -> None:
        self.name, self.argv, self.port, self.log_path = name, argv, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.env = env  # the whole environment (None: this process's); PYTHONUNBUFFERED is added
        self.ready_timeout_s, self.ready_paths, self.grace_s = ready_timeout_s, ready_paths, grace_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"{self.name} exited with {self.proc.returncode} while starting; log: {self.log_path}"
                                f"\n{self.tail()}")
            for path in self.ready_paths:
                try:
                    with urllib.request.urlopen(self.url + path, timeout=2) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.5)
        raise PeerError(f"{self.name} not ready after {self.ready_timeout_s:.0f}s; log: {self.log_path}")

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group: a server's children too
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
