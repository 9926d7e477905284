"""gateway/ is five subpackages in layers, and its top level stays small.

    api  ->  serving  ->  control  ->  backends  ->  routing

A module may import (at import time, `if TYPE_CHECKING:` included, as tests/test_import_cycles.py counts)
its own subpackage and the ones to its right, never one to its left; no subpackage imports the assembly
modules (app, server, openapi, middleware). Imports inside functions are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_cycles import _import_time_nodes  # what runs at import: one definition

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
LAYERS = ("routing", "backends", "control", "serving", "api")  # lowest first
ASSEMBLY = ("gateway.app", "gateway.server", "gateway.openapi", "gateway.middleware")
MAX_TOP_LEVEL_MODULES = 12


def imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """The dotted names `source` (the text of `module`) imports at import time; `from a import b` counts
    as `a.b` too, since b may be a submodule."""
    names: set[str] = set()
    for node in _import_time_nodes(ast.parse(source).body):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def layer_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gateway" and parts[1] in LAYERS else None


def violations(module: str, names: set[str]) -> list[str]:
    """What `module` must not import of `names`: a layer above its own, or an assembly module."""
    own = layer_of(module)
    if own is None:
        return []
    out = []
    for name in sorted(names):
        other = layer_of(name)
        if other is not None and LAYERS.index(other) > LAYERS.index(own):
            out.append(f"{module} imports {name} ({other} is above {own})")
        if any(name == a or name.startswith(a + ".") for a in ASSEMBLY):
            out.append(f"{module} imports the assembly module {name}")
    return out


def _modules():
    for path in sorted(GATEWAY.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        yield ".".join(parts), path, is_package


def test_the_checker_sees_an_upward_import():
    names = imported("from gateway.serving import runs\nif True:\n    import gateway.api.tokenize\n",
                     "gateway.control.admin")
    assert violations("gateway.control.admin", names) == [
        "gateway.control.admin imports gateway.api.tokenize (api is above control)",
        "gateway.control.admin imports gateway.serving (serving is above control)",
        "gateway.control.admin imports gateway.serving.runs (serving is above control)",
    ]
    assert violations("gateway.api.responses", imported("from gateway.serving.start import start",
                                                       "gateway.api.responses")) == []
    assert violations("gateway.routing.policy", {"gateway.app"}) == [
        "gateway.routing.policy imports the assembly module gateway.app"]


def test_no_subpackage_imports_one_above_it():
    found = [v for name, path, is_package in _modules()
             for v in violations(name, imported(path.read_text(), name, is_package))]
    assert found == []
    assert {name.split(".")[1] for name, _, _ in _modules() if layer_of(name)} == set(LAYERS)


def test_the_top_level_stays_small():
    top = sorted(p.name for p in GATEWAY.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_app_only_assembles():
    """app.py builds and wires the parts: `build_app`, and `Gateway` with `__init__` and `lifespan` only."""
    tree = ast.parse((GATEWAY / "app.py").read_text())
    defs = {n.name: n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    assert set(defs) == {"Gateway", "build_app"}
    methods = {n.name for n in defs["Gateway"].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert methods == {"__init__", "lifespan"}
