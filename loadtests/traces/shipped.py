"""The traces the project ships, in loadtests/traces/data/ (their README names each one's source and licence).

`trace_dir()` is where a named trace is read from: `DUET_TRACE_DIR` when set (a team's own copies, or longer
downloads of the same traces under the same file names), else the shipped folder. `resolve(text)` turns a
shipped name (`mooncake`, `azure_code`, `azure_conv`) into its path under `trace_dir()`; anything else is taken
as a file path. Nothing in the project reads a trace from outside the repository unless told to.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "data"
ENV = "DUET_TRACE_DIR"
FILES = {"mooncake": "mooncake_conversation_trace.jsonl",
         "azure_code": "AzureLLMInferenceTrace_code.csv",
         "azure_conv": "AzureLLMInferenceTrace_conv.csv"}


def trace_dir() -> Path:
    return Path(os.environ[ENV]) if os.environ.get(ENV) else SHIPPED_DIR


def path_of(name: str, directory: Path | None = None) -> Path:
    """The file of shipped trace `name` under `directory` (default: `trace_dir()`)."""
    return (directory or trace_dir()) / FILES[name]


def resolve(text: str | Path) -> Path:
    """A shipped trace's name -> its path; a path stays a path."""
    return path_of(text) if isinstance(text, str) and text in FILES else Path(text)
