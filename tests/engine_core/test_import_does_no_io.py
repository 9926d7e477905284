"""Importing engine_core, and every module in it, starts no process and writes no file; the native builds happen
when a worker starts (engine_core/mkl_on_amd.py, called by `duet engine`) or a model first runs on them
(engine_core/kernels/cpu_native.py).

Each check runs in a fresh interpreter with a Python audit hook (sys.addaudithook) that records every process
start and every file opened for writing, and an empty cache dir of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_HOOK = """
import json, os, sys
events = []
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    if event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.fork", "os.exec", "os.spawn"):
        events.append([event, repr(args)[:300]])
    elif event == "open" and isinstance(args[0], str):
        path, mode, flags = args
        if (mode is None and flags & WRITE) or (isinstance(mode, str) and any(c in mode for c in "wax+")):
            if path != os.devnull and not path.startswith(os.environ["TMPDIR"]):
                events.append([event, path])
    elif event == "ctypes.dlopen" and args[0] and args[0].startswith(os.environ["DUET_CACHE_DIR"]):
        events.append([event, args[0]])

sys.addaudithook(hook)
"""

_IMPORT_ALL = _HOOK + """
import importlib, pkgutil
import engine_core
names = [m.name for m in pkgutil.walk_packages(engine_core.__path__, "engine_core.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "events": events, "mkl": sys.modules["engine_core.mkl_on_amd"].STATUS}))
"""

# `duet engine paged` up to the worker's own main, which is a stand-in here that reports what the start did
_WORKER_START = _HOOK + """
import types
seen = {}
def main(config):
    seen["torch_loaded"] = "torch" in sys.modules
    seen["mkl"] = sys.modules["engine_core.mkl_on_amd"].STATUS
    return 0
sys.modules["engine_paged.worker"] = types.SimpleNamespace(main=main)
from duet.cli import main as duet
duet(["engine", "paged", "--port", "1"])
print(json.dumps({**seen, "events": events}))
"""


def _run(code: str, tmp_path: Path) -> dict:
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "DUET_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_every_engine_core_module_builds_loads_and_writes_nothing(tmp_path):
    result = _run(_IMPORT_ALL, tmp_path)
    assert {"engine_core.mkl_on_amd", "engine_core.kernels.cpu_native", "engine_core.worker",
            "engine_core.parallel.runner"} <= set(result["modules"])
    assert result["events"] == [], "an import started a process or wrote a file"
    assert result["mkl"] == "not tried"
    assert not (tmp_path / "cache").exists(), "nothing is built into the cache dir at import"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_workers_start_unlocks_mkl_before_torch_loads(tmp_path):
    result = _run(_WORKER_START, tmp_path)
    assert result["torch_loaded"] is False  # the stand-in main imports nothing: the start itself loaded no torch
    if result["mkl"].startswith("MKL dispatches by CPU features on this AMD CPU"):
        assert [e for e, _ in result["events"]] == ["subprocess.Popen", "ctypes.dlopen"]  # cc, then the shim
        assert list((tmp_path / "cache" / "mkl-on-amd").rglob("*.so"))
    else:  # not an AMD CPU, no compiler, or DUET_MKL_ON_AMD=0 in this environment: said, and nothing built
        assert result["mkl"] != "not tried" and result["events"] == []
