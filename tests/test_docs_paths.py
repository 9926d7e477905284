"""What the docs name exists: every repository path, every `python -m` module and every relative link.

A newcomer follows the paths the docs name (`loadtests/experiments/peer.py`, `docs/data/...json`,
`deploy/gateway.yaml`), runs the commands they print (`python -m loadtests.profiles.profile_step`) and clicks
their links; a file that moved without its docs leaves all three pointing nowhere. The pages checked are the
README, docs/*.md and docs/history/*.md; docs/architecture.md has its own test (tests/test_architecture_doc.py).

What counts as a repository path: a word that starts with one of the project's top-level folders and a slash
(`gateway/routing/policy.py`, `docs/data/`); `{a,b}` in it is expanded as the shell would, `*` is a glob. A path with a
placeholder in capitals (`docs/data/compile-DATE-t1.json`) is a template, not a file. A dotted name that starts
with one of the Python packages (`gateway.routing.policy.route`, `loadtests.load.workloads.mix`) must name a module or
package in its first two parts at least (what follows may be an attribute). A relative link must resolve from
its page, and its `#anchor`, if any, must be a heading of the target page (GitHub's anchors).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("deploy", "docs", "duet", "engine_core", "engine_paged", "engine_prefix", "gateway", "loadtests",
               "proto", "tests")
PACKAGES = ("duet", "gateway", "engine_core", "engine_paged", "engine_prefix", "loadtests", "tests")
# A path the history names on purpose although it no longer exists: (page, path) -> why.
HISTORICAL = {
    ("docs/history/cpu-engine-step.md", "engine_core/layer_attention.py"):
        "the module of a change that was measured and reverted (commit 7f842e6), named 'of that commit'",
}

PATH_RE = re.compile(r"(?<![\w./~-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w.{},*/-]*[\w}*/])")
PLACEHOLDER_RE = re.compile(r"(?<![A-Za-z])(?:DATE|DIR|FILE|NAME|PATH|KIND)(?![A-Za-z])")
MODULE_RE = re.compile(r"python -m ([A-Za-z_][\w.]*)")
DOTTED_RE = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)")
FILE_SUFFIXES = {"py", "json", "yaml", "yml", "md", "txt", "toml", "png", "jsonl", "csv", "proto"}
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    docs = ROOT / "docs"
    return ([ROOT / "README.md"] + sorted(p for p in docs.glob("*.md") if p.name != "architecture.md")
            + sorted((docs / "history").glob("*.md")))


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _lines(page: Path):
    yield from enumerate(page.read_text().splitlines(), 1)


def expand_braces(path: str) -> list[str]:
    """`a-{1,2}.json` -> [`a-1.json`, `a-2.json`], as the shell expands it."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [out for alt in m.group(1).split(",") for out in expand_braces(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path.rstrip("/")))
    return (ROOT / path).exists()


def missing_paths() -> list[str]:
    out = []
    for page in pages():
        for n, line in _lines(page):
            for m in PATH_RE.finditer(line):
                named = m.group(1)
                if PLACEHOLDER_RE.search(named) or (_rel(page), named) in HISTORICAL:
                    continue
                out += [f"{_rel(page)}:{n}: {p}" for p in expand_braces(named) if not _exists(p)]
    return out


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    if base.is_dir():  # a namespace package (no __init__.py)
        return base
    return None


def missing_modules() -> list[str]:
    out = []
    for page in pages():
        for n, line in _lines(page):
            for m in MODULE_RE.finditer(line):
                module = m.group(1).rstrip(".")
                target = _module_file(module)
                if target is None or (target.is_dir() or target.name == "__init__.py") and not (
                        ROOT.joinpath(*module.split(".")) / "__main__.py").exists():
                    out.append(f"{_rel(page)}:{n}: python -m {module}")
            for m in DOTTED_RE.finditer(line):
                parts = m.group(1).rstrip(".").split(".")
                if parts[-1] in FILE_SUFFIXES:
                    continue  # a file name such as duet.json
                if _module_file(".".join(parts[:2])) is None:
                    out.append(f"{_rel(page)}:{n}: {'.'.join(parts)}")
    return out


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, in_code = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^#{1,6} (.*)$", line)
        if m:
            a = github_anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            found.add(a if n == 0 else f"{a}-{n}")
    return found


def broken_links() -> list[str]:
    out = []
    for page in pages():
        for n, line in _lines(page):
            for m in LINK_RE.finditer(line):
                target = m.group(1)
                if re.match(r"^[a-z]+:", target):
                    continue  # http(s), mailto: not this test's business
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    out.append(f"{_rel(page)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    out.append(f"{_rel(page)}:{n}: {target} (no heading with that anchor)")
    return out


def test_every_repository_path_the_docs_name_exists():
    missing = missing_paths()
    assert not missing, "the docs name paths that do not exist:\n  " + "\n  ".join(missing)


def test_every_module_the_docs_name_exists():
    missing = missing_modules()
    assert not missing, "the docs name modules that do not exist (or cannot run with -m):\n  " + "\n  ".join(missing)


def test_every_relative_link_in_the_docs_resolves():
    broken = broken_links()
    assert not broken, "broken links in the docs:\n  " + "\n  ".join(broken)


def test_the_checks_see_what_they_must():
    assert expand_braces("docs/data/peer-run{1,2}.json") == ["docs/data/peer-run1.json", "docs/data/peer-run2.json"]
    assert PATH_RE.findall("see `loadtests/experiments/peer.py`, docs/data/ and tok/s") == [
        "loadtests/experiments/peer.py", "docs/data/"]
    assert PLACEHOLDER_RE.search("docs/data/compile-DATE-t1.json") and not PLACEHOLDER_RE.search("docs/history/README.md")
    assert DOTTED_RE.findall("`gateway.routing.policy.route` in duet.json") == ["gateway.routing.policy.route", "duet.json"]
    assert github_anchor("Duet's engines: `duet bench peer` (2026-12-02)") == "duets-engines-duet-bench-peer-2026-12-02"
    assert ROOT / "docs" / "benchmarks.md" in pages() and ROOT / "docs" / "architecture.md" not in pages()
