"""The tests are a package tree: every folder with test modules has an `__init__.py`, so two test modules of the
same name in different folders both collect and the shared helpers are imported as `tests.support.*`; no test
edits `sys.path` to reach a helper."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_folder_of_python_files_is_a_package():
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"no __init__.py in {missing}"


def test_no_test_edits_sys_path():
    edits = [f"{p.relative_to(TESTS.parent)}:{n}" for p in TESTS.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if "sys.path." + "insert" in line
             or "sys.path." + "append" in line]
    assert not edits, f"sys.path edited at {edits}: import helpers from tests.support instead"
