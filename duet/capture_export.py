"""`duet capture export --gateway URL [--admin-key KEY] --out FILE`: the gateway's traffic capture
(GET /admin/capture, gateway/control/capture.py) written as a Mooncake JSONL trace, what `duet bench advise
--trace FILE` replays. `fetch_capture` is also how `duet bench advise --from-gateway URL` reads it.
The admin key comes from --admin-key or DUET_ADMIN_KEY."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from duet.admin_get import admin_get


class CaptureExportError(ValueError):
    """The gateway did not hand over its capture (the message says why and what to do)."""


def fetch_capture(gateway: str, admin_key: str | None, timeout_s: float = 60.0) -> str:
    """The capture as JSON lines (possibly empty)."""
    r = admin_get(gateway, "/admin/capture", admin_key, timeout_s, CaptureExportError)
    if r.headers.get("x-duet-capture-enabled") == "false" and not r.text.strip():
        raise CaptureExportError("the gateway's capture is off: set `capture: {enabled: true}` in its config "
                                 "(docs/operations.md); `duet up` captures by default")
    return r.text


def main(args: argparse.Namespace) -> int:
    try:
        text = fetch_capture(args.gateway, args.admin_key or os.environ.get("DUET_ADMIN_KEY"))
    except CaptureExportError as e:
        print(f"duet capture export: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(text)
    print(f"wrote {sum(1 for line in text.splitlines() if line.strip())} records to {args.out}")
    return 0
