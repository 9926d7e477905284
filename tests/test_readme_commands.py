"""The README lists every command: each `duet` and `duet bench` subcommand the parsers define, and each make target.

The commands are read from the parsers themselves (duet/cli.py's `build_parser`, and loadtests/cli.py's for
`duet bench`, which registers every bench module's subcommand), walking nested subcommands (`duet engine paged`,
`duet bench baseline save`), so a command added to a parser without a README line fails here. A command is
listed when the README names it in code, as `` `duet bench fleet `` or `` `duet bench fleet` ``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from duet.cli import build_parser as duet_parser
from loadtests.cli import build_parser as bench_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    """Every command path under `parser`, parents included: ['duet up', 'duet engine', 'duet engine paged', ...]."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix} {name}"
                out += [path, *subcommands(sub, path)]
    return out


def listed(command: str) -> bool:
    return re.search("`" + re.escape(command) + r"[ `]", README) is not None


def make_targets() -> list[str]:
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return phony.group(1).split() if phony else []


def test_every_duet_command_is_in_the_readme():
    missing = [c for c in subcommands(duet_parser(), "duet") if not listed(c)]
    assert not missing, "README.md does not list these `duet` commands: " + ", ".join(missing)


def test_every_duet_bench_command_is_in_the_readme():
    missing = [c for c in subcommands(bench_parser(), "duet bench") if not listed(c)]
    assert not missing, "README.md does not list these `duet bench` commands: " + ", ".join(missing)


def test_every_make_target_is_in_the_readme():
    missing = [t for t in make_targets() if not listed(f"make {t}")]
    assert not missing, "README.md does not list these make targets: " + ", ".join(f"make {t}" for t in missing)


def test_the_walk_finds_nested_commands():
    duet = subcommands(duet_parser(), "duet")
    bench = subcommands(bench_parser(), "duet bench")
    assert {"duet up", "duet engine paged", "duet model pull", "duet deploy scale-pools", "duet bench"} <= set(duet)
    assert {"duet bench peer", "duet bench fleet", "duet bench baseline check"} <= set(bench)
    assert {"up", "test", "gpu-check"} <= set(make_targets())
    assert not listed("duet no-such-command")
