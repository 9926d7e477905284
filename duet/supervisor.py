"""`Supervisor`: named child processes kept running, restarted with backoff, given up on when they crash-loop.

`duet up` uses it for every worker and gateway; anything else that manages the stack's processes (a pool
planner turning a paged worker into a prefix one, several gateways) calls the same small API:

    sup = Supervisor(log_dir, on_event=print)
    sup.start("paged-0", argv, env)      # spawn under a name (its log: log_dir/paged-0.log, appended)
    sup.restart("paged-0", new_argv)     # stop it (SIGTERM, drain, SIGKILL) and start again, maybe as another argv
    sup.stop("paged-0")                  # stop it and forget it: no restart
    sup.poll()                           # call often: restarts children that exited, returns what happened
    sup.shutdown()                       # stop everything: SIGTERM to all, SIGKILL after the grace period

A child that exits is started again after a backoff that doubles per consecutive failure (a run longer
than `RestartPolicy.healthy_after_s` resets it); more than `max_restarts` restarts within `window_s`
is a crash loop: the child is reported and left down. Each child runs in its own process group (so a
Ctrl-C reaches only the supervising process) and asks the kernel for SIGTERM should the supervisor die
(PR_SET_PDEATHSIG), so no orphans outlive it. The supervisor runs no threads: `poll()` is driven by the
caller's loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_restarts: int = 5  # within window_s; one more is a crash loop
    window_s: float = 60.0
    healthy_after_s: float = 30.0  # a run this long resets the backoff
    stop_grace_s: float = 20.0  # SIGTERM -> SIGKILL (workers drain in between)


@dataclass(frozen=True)
class Event:
    name: str
    kind: str  # "exited" | "restarted" | "gave_up"
    message: str


@dataclass
class _Child:
    argv: list[str]
    env: dict[str, str] | None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive short runs: the backoff exponent
    restarts: deque = field(default_factory=deque)  # times of recent restarts (crash-loop window)
    restart_at: float | None = None  # when a pending restart is due
    given_up: bool = False


_PR_SET_PDEATHSIG = 1
try:  # resolved in the parent, so the forked child calls a function pointer and loads nothing
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: children are stopped by their owners only
    _prctl = None


def ask_for_parent_death_signal() -> None:
    """A `preexec_fn`: in the child before exec, ask the kernel for SIGTERM when the parent dies (Linux;
    nothing elsewhere). The signal comes when the thread that started the child exits, so start children
    from a thread that lives as long as they should."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _die_with_parent() -> None:
    """In the child before exec: own process group, SIGTERM when the parent dies."""
    os.setpgrp()
    ask_for_parent_death_signal()


class Supervisor:
    def __init__(self, log_dir: Path, policy: RestartPolicy | None = None,
                 on_event: Callable[[Event], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.log_dir = Path(log_dir)
        self.policy = policy or RestartPolicy()
        self.on_event = on_event
        self.clock = clock
        self._children: dict[str, _Child] = {}

    # -- the API ----------------------------------------------------------------------------------
    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        """Spawn `argv` under `name` (which must not be running); returns its pid."""
        child = self._children.get(name)
        if child is not None and child.proc is not None and child.proc.poll() is None:
            raise ValueError(f"{name} is already running (pid {child.proc.pid})")
        child = self._children[name] = _Child(list(argv), env)
        self._spawn(name, child)
        return child.proc.pid

    def restart(self, name: str, argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
        """Stop `name` gracefully and start it again, with a new argv/env when given (the old ones when not)."""
        old = self._children[name]
        self._terminate([old])
        return self.start(name, argv if argv is not None else old.argv, env if env is not None else old.env)

    def stop(self, name: str) -> int | None:
        """Stop `name` gracefully and forget it; its exit code (None if it was not running)."""
        child = self._children.pop(name)
        self._terminate([child])
        return child.proc.returncode if child.proc else None

    def shutdown(self) -> None:
        """Stop every child: the most recently started first get SIGTERM first, all wait together."""
        children = list(reversed(self._children.values()))
        self._children.clear()
        self._terminate(children)

    def pid(self, name: str) -> int | None:
        child = self._children.get(name)
        return child.proc.pid if child and child.proc and child.proc.poll() is None else None

    def names(self) -> list[str]:
        return list(self._children)

    def given_up(self) -> list[str]:
        return [n for n, c in self._children.items() if c.given_up]

    def log_tail(self, name: str, chars: int = 2000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def poll(self) -> list[Event]:
        """Notice exits, schedule and perform restarts; returns (and reports) what happened."""
        now, events = self.clock(), []
        for name, c in self._children.items():
            if c.given_up:
                continue
            if c.restart_at is None and c.proc is not None and c.proc.poll() is not None:
                events.append(self._on_exit(name, c, now))
            if c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                self._spawn(name, c)
                events.append(Event(name, "restarted", f"{name} restarted (pid {c.proc.pid}, "
                                                       f"restart {len(c.restarts)} in {self.policy.window_s:g} s)"))
        for e in events:
            if self.on_event is not None:
                self.on_event(e)
        return events

    # -- internals --------------------------------------------------------------------------------
    def _on_exit(self, name: str, c: _Child, now: float) -> Event:
        code = c.proc.returncode
        p = self.policy
        c.failures = 0 if now - c.started_at >= p.healthy_after_s else c.failures + 1
        while c.restarts and now - c.restarts[0] > p.window_s:
            c.restarts.popleft()
        if len(c.restarts) >= p.max_restarts:
            c.given_up = True
            return Event(name, "gave_up", f"{name} exited with {code} after {len(c.restarts)} restarts in "
                                          f"{p.window_s:g} s: crash loop, not restarting it")
        delay = min(p.backoff_max_s, p.backoff_initial_s * 2 ** max(0, c.failures - 1))
        c.restarts.append(now)
        c.restart_at = now + delay
        return Event(name, "exited", f"{name} exited with {code}; restarting in {delay:.1f} s")

    def _spawn(self, name: str, c: _Child) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # preexec_fn is safe here: the supervisor runs no threads
        with open(self.log_dir / f"{name}.log", "ab") as log:
            c.proc = subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=_die_with_parent,  # noqa: PLW1509
                                      env=dict(os.environ, PYTHONUNBUFFERED="1", **(c.env or {})))
        c.started_at = self.clock()

    def _terminate(self, children: list[_Child]) -> None:
        procs = [c.proc for c in children if c.proc is not None]
        for c in children:
            c.restart_at = None
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.policy.stop_grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # whatever is left of the group, grandchildren too
            p.wait()
