"""`duet capture export --gateway URL [--admin-key KEY] --out FILE`: the gateway's traffic capture
(GET /admin/capture, gateway/control/capture.py) written as a Mooncake JSONL trace, what `duet bench advise
--trace FILE` replays. `fetch_capture` is also how `duet bench advise --from-gateway URL` reads it.
The admin key comes from --admin-key or DUET_ADMIN_KEY."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx


class CaptureExportError(ValueError):
    """The gateway did not hand over its capture (the message says why and what to do)."""


def fetch_capture(gateway: str, admin_key: str | None, timeout_s: float = 60.0) -> str:
    """The capture as JSON lines (possibly empty)."""
    url = gateway.rstrip("/") + "/admin/capture"
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise CaptureExportError(f"cannot reach {url}: {e}") from None
    if r.status_code in (401, 403):
        raise CaptureExportError(f"GET {url} answered {r.status_code}: give the gateway's admin key "
                                 f"(--admin-key or DUET_ADMIN_KEY)")
    if r.status_code != 200:
        raise CaptureExportError(f"GET {url} answered {r.status_code}: {r.text[:200]}")
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
