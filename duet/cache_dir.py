"""Duet's user cache dir and the one way things are built into it (models, wheels, GGUF files).

`build_once(final, build)` makes `final` by having `build(tmp)` fill a private temp dir that is then
renamed into place, so several processes may build the same thing at once: a loser of the rename race
drops its copy and uses the winner's, and nobody ever sees a half-written directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """The user cache dir for Duet (`DUET_CACHE_DIR` overrides)."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("DUET_CACHE_DIR") or user_cache_dir("duet"))


def build_once(final: Path, build: Callable[[Path], object], marker: str = "config.json") -> Path:
    """`final`, built by `build(tmp_dir)` unless it already holds `marker`."""
    if (final / marker).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / marker).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
