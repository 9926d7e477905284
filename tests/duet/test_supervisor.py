"""duet/supervisor.py with real child processes: restart after kill -9, backoff, crash-loop give-up,
restart as another argv, and no process left after shutdown."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from duet.supervisor import RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASHER = [sys.executable, "-c", "raise SystemExit(3)"]
FAST = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2, max_restarts=3, window_s=30.0,
                     healthy_after_s=30.0, stop_grace_s=5.0)


def _poll_until(sup: Supervisor, predicate, timeout_s: float = 15.0) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events += sup.poll()
        if predicate(events):
            return events
        time.sleep(0.02)
    raise AssertionError(f"timed out; events so far: {events}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture
def sup(tmp_path):
    s = Supervisor(tmp_path, FAST)
    yield s
    s.shutdown()


def test_a_killed_child_is_restarted_and_its_neighbour_is_untouched(sup):
    a, b = sup.start("a", SLEEPER), sup.start("b", SLEEPER)
    os.kill(a, signal.SIGKILL)
    events = _poll_until(sup, lambda ev: any(e.kind == "restarted" for e in ev))
    assert [e.kind for e in events] == ["exited", "restarted"] and "exited with -9" in events[0].message
    assert sup.pid("a") not in (None, a)
    assert sup.pid("b") == b  # the healthy child kept running


def test_a_crash_loop_is_reported_and_given_up(sup, tmp_path):
    reported = []
    sup.on_event = reported.append
    sup.start("bad", CRASHER)
    events = _poll_until(sup, lambda ev: any(e.kind == "gave_up" for e in ev))
    assert sum(e.kind == "restarted" for e in events) == FAST.max_restarts
    assert events[-1].kind == "gave_up" and "crash loop" in events[-1].message and reported == events
    assert sup.given_up() == ["bad"] and sup.pid("bad") is None
    time.sleep(0.3)
    assert sup.poll() == []  # left down


def test_backoff_doubles_per_consecutive_failure(tmp_path):
    now = [0.0]
    sup = Supervisor(tmp_path, RestartPolicy(backoff_initial_s=1.0, backoff_max_s=3.0, max_restarts=10),
                     clock=lambda: now[0])
    sup.start("bad", CRASHER)
    delays = []
    for _ in range(4):
        while sup.pid("bad") is not None:
            time.sleep(0.01)
        exited = sup.poll()
        assert exited[0].kind == "exited"
        delays.append(float(exited[0].message.split("restarting in ")[1].split(" ")[0]))
        now[0] += delays[-1] - 0.01
        assert sup.poll() == []  # not yet
        now[0] += 0.02
        assert [e.kind for e in sup.poll()] == ["restarted"]
    assert delays == [1.0, 2.0, 3.0, 3.0]
    sup.shutdown()


def test_restart_with_another_argv_and_stop(sup, tmp_path):
    first = sup.start("w", SLEEPER)
    second = sup.restart("w", [sys.executable, "-c", "print('as the other kind'); import time; time.sleep(120)"])
    assert _gone(first) and second != first
    deadline = time.monotonic() + 10
    while "as the other kind" not in sup.log_tail("w") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "as the other kind" in sup.log_tail("w")
    assert sup.stop("w") == -signal.SIGTERM and _gone(second) and sup.names() == []
    with pytest.raises(ValueError, match="already running"):
        sup.start("x", SLEEPER)
        sup.start("x", SLEEPER)


def test_shutdown_kills_what_ignores_sigterm(tmp_path):
    sup = Supervisor(tmp_path, RestartPolicy(stop_grace_s=0.5))
    stubborn = sup.start("stubborn", [sys.executable, "-c",
                                      ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                       "print('ready', flush=True); time.sleep(120)")])
    deadline = time.monotonic() + 10
    while "ready" not in sup.log_tail("stubborn") and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    sup.shutdown()
    assert _gone(stubborn) and time.monotonic() - t0 < 5
