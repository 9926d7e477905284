"""No import cycles among the project's modules.

Counted: every import that runs when a module is imported (module and class level, inside `if` and
`try`, `if TYPE_CHECKING:` included: a cycle hidden from the interpreter is still two modules that
cannot be read or changed apart). Not counted: imports inside functions, the project's one way to
reach up a layer on purpose (e.g. engine_core.llm building engine_paged's scheduler).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("duet", "engine_core", "engine_paged", "engine_prefix", "gateway", "loadtests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_time_nodes(body):
    """Statements that run at import: recurse into if/try/with/class, never into functions."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _import_time_nodes(inner)


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _import_time_nodes(ast.parse(path.read_text(), str(path)).body):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                # `from pkg import submodule` loads the submodule; pkg's __init__ is already running
                targets = submodules or [base]
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_two_module_cycle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_project_has_no_import_cycles():
    graph = import_graph()
    assert "engine_paged.scheduler" in graph and "engine_paged.postprocess" in graph["engine_paged.scheduler"]
    assert cycles(graph) == []


def test_engine_core_imports_no_engine_kind_at_import_time():
    graph = import_graph()
    upward = {(m, t) for m, ts in graph.items() if m.startswith("engine_core")
              for t in ts if t.startswith(("engine_paged", "engine_prefix"))}
    assert upward == set()
