"""The GPU check's records: one JSON file per step under the output folder, and the way steps run commands.

A step's record: `name`, `status` (passed / failed / skipped), `reason` (why it was skipped or failed; empty when
it passed), `seconds`, `figures` (what it measured or counted) and `details` (commands, log files, data files).
Commands run as child processes in their own session, with their output in `logs/`, so a step that hangs is
killed with everything it started when its time is up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATUSES = ("passed", "failed", "skipped")


@dataclass
class Outcome:
    status: str
    reason: str = ""
    figures: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Record(Outcome):
    name: str = ""
    title: str = ""
    seconds: float = 0.0


def run_step(name: str, title: str, fn: Callable[[], Outcome], out: Path, index: int) -> Record:
    """Run one step, time it, turn an exception into a failure, write `NN-name.json`."""
    start = time.monotonic()
    try:
        outcome = fn()
    except Exception as exc:  # noqa: BLE001 - recorded as this step's failure; the other steps still run
        outcome = Outcome("failed", f"{type(exc).__name__}: {exc}",
                          details={"traceback": traceback.format_exc()[-4000:]})
    record = Record(**asdict(outcome), name=name, title=title, seconds=round(time.monotonic() - start, 2))
    write_json(out / f"{index:02d}-{name}.json", asdict(record))
    return record


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


@dataclass(frozen=True)
class Ran:
    rc: int | None  # None: killed at its time limit
    seconds: float
    stdout: str
    log: Path  # stderr (and stdout, unless captured)

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:])


def run_command(argv: list[str], log: Path, timeout_s: float, env: dict, cwd: Path,
                capture_stdout: bool = False) -> Ran:
    """Run argv with its stderr (and stdout unless captured) in `log`; kill its whole session past timeout_s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as err:
        err.write(f"$ {' '.join(argv)}\n")
        err.flush()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE if capture_stdout else err,
                                stderr=err, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            rc = None
    return Ran(rc, round(time.monotonic() - start, 2), stdout or "", log)


def junit_counts(path: Path) -> dict:
    """Test counts from pytest's --junitxml file (empty if it was not written)."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**n, "failed_tests": failed[:30]}
