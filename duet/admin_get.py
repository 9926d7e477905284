"""One GET of a running gateway's admin API, for the commands that read it from outside (`duet capture export`,
`duet bench advise --from-gateway`'s calibration): the admin key as a bearer token, and every failure as one
line that says what to do, raised as `error` (the caller's own ValueError subclass, or ValueError)."""

from __future__ import annotations

import httpx


def admin_get(gateway: str, path: str, admin_key: str | None, timeout_s: float,
              error: type[ValueError] = ValueError) -> httpx.Response:
    """GET `path` of the gateway's admin API; the answer when it is 200, else `error` with the reason."""
    url = gateway.rstrip("/") + path
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise error(f"cannot reach {url}: {e}") from None
    if r.status_code in (401, 403):
        raise error(f"GET {url} answered {r.status_code}: give the gateway's admin key (--admin-key or "
                    f"DUET_ADMIN_KEY)")
    if r.status_code != 200:
        raise error(f"GET {url} answered {r.status_code}: {r.text[:200]}")
    return r
