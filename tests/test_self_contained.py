"""A clone stands on its own: no file of the project reads anything beside the repository (a user's clone
has no sibling folders), and the traces the tests and benchmarks replay are shipped with it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from loadtests.traces import shipped
from loadtests.traces.formats import load_any

ROOT = Path(__file__).resolve().parents[1]
# written in pieces so that this file does not name what it forbids
FORBIDDEN = ("../" + "shared", "shared" + "/data", "parents" + "[3]", '"shared"' + " /")


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / n for n in names.decode().split("\0") if n]
    return [f for f in files if f.is_file() and f.suffix not in (".png", ".jsonl", ".csv", ".safetensors")]


def test_no_project_file_names_a_folder_outside_the_repository():
    offenders = []
    for f in _tracked_text_files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        offenders += [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                      if any(s in line for s in FORBIDDEN)]
    assert not offenders, "\n".join(offenders)


def test_the_named_traces_are_shipped_with_their_record_counts():
    counts = {"mooncake": 12_031, "azure_conv": 19_366, "azure_code": 8_819}  # the README's table
    for name, n in counts.items():
        assert len(load_any(shipped.path_of(name, shipped.SHIPPED_DIR))) == n, name


def test_DUET_TRACE_DIR_points_the_named_traces_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv(shipped.ENV, str(tmp_path))
    assert shipped.resolve("mooncake") == tmp_path / "mooncake_conversation_trace.jsonl"
    assert shipped.resolve("my.jsonl") == Path("my.jsonl")
    monkeypatch.delenv(shipped.ENV)
    assert shipped.resolve("mooncake").parent == shipped.SHIPPED_DIR
