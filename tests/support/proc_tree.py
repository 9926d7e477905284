"""Process-tree helpers for tests that check a stack leaves no process behind.

Read straight from /proc (Linux), so a test sees every descendant, including ones a supervisor started.
"""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, grandchildren, ...), found by walking /proc's parent links."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we read
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie has exited (only its parent's wait is missing) and counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
