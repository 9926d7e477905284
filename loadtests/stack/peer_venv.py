"""A peer's virtualenv (real vLLM, a peer router), installed once under Duet's cache dir, written once.

`install_venv(venv, requirement, ...)` makes the virtualenv with the base interpreter (a peer must not see
Duet's packages), pip-installs the one requirement, runs `after` (a fix-up of the install) and writes a
marker file last, so an interrupted install is redone, not trusted. Every command's output goes to a log
beside the virtualenv; a failing one raises PeerError naming that log.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from loadtests.stack.server_process import PeerError

_MARKER = ".duet-peer-installed"


def installed(venv: Path) -> bool:
    return (venv / _MARKER).is_file()


def run_logged(cmd: list[str], log: Path) -> None:
    with log.open("ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise PeerError(f"{' '.join(cmd[:4])} ... failed with exit code {done.returncode}; see {log}")


def base_python() -> str:
    """The base interpreter, not the project's virtualenv."""
    base = Path(sysconfig.get_config_var("BINDIR") or Path(sys.base_prefix) / "bin") / "python3"
    return str(base if base.exists() else sys.executable)


def install_venv(venv: Path, requirement: str, progress=print, *, how_long: str = "",
                 after: Callable[[Path, Path], None] | None = None) -> Path:
    """`venv`, with `requirement` installed on first use; `after(venv, log)` runs before the marker is written."""
    if installed(venv):
        return venv
    venv.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-install.log"
    progress(f"installing {requirement} into {venv} (log: {log}){how_long}")
    if not (venv / "bin" / "python").exists():
        run_logged([base_python(), "-m", "venv", str(venv)], log)
    run_logged([str(venv / "bin" / "pip"), "install", "-q", requirement], log)
    if after is not None:
        after(venv, log)
    (venv / _MARKER).write_text(requirement + "\n")
    return venv
