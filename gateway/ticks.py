"""`sleep_to_tick(interval_s)`: the gateway's periodic tasks wake together, not each on its own.

Every background loop of the gateway (the fleet's polls, the pool planner, the rollback controller, the shadow
sync, the capture's flush, the stream watchdog, uvicorn's housekeeping) wakes about once a second. Each slept
from whenever its last round ended, so they woke at as many different moments of every second. A wake of a
process that slept costs far more than the work it does (its caches are cold: ~0.15 ms on a 2-core VM,
docs/benchmarks.md). Sleeping until the next multiple of the interval on the loop's clock puts every loop of one
interval (and every whole second of the shorter ones) in the same wake of the loop: in front of busy backends at
0.6 requests/s, 17.1 -> 14.5 ms of the gateway's CPU a request (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio

EARLY_S = 0.005  # uvloop fires a timer up to a millisecond early (libuv counts milliseconds)


def tick_wait(interval_s: float) -> float:
    """Seconds until the running loop's clock next reaches a multiple of `interval_s`: EARLY_S to `interval_s` +
    EARLY_S (a tick due sooner than EARLY_S is the one the caller just woke for, a little early)."""
    wait = interval_s - asyncio.get_running_loop().time() % interval_s
    return wait + interval_s if wait < EARLY_S else wait


async def sleep_to_tick(interval_s: float) -> None:
    """Sleep until the running loop's clock next reaches a multiple of `interval_s` (`tick_wait`)."""
    await asyncio.sleep(tick_wait(interval_s))
