"""The gateway's periodic tasks wake together (gateway/ticks.py): loops that sleep to the same tick from different
moments wake in the same turn of the event loop, on the tick."""

from __future__ import annotations

import asyncio

from gateway.ticks import EARLY_S, sleep_to_tick, tick_wait


async def test_loops_started_at_different_moments_wake_on_the_same_ticks():
    loop = asyncio.get_running_loop()
    wakes: dict[str, list[float]] = {"a": [], "b": []}

    end = loop.time() + 0.7

    async def periodic(name: str, start_after_s: float) -> None:
        await asyncio.sleep(start_after_s)
        while loop.time() < end:
            await sleep_to_tick(0.2)
            wakes[name].append(loop.time())

    await asyncio.gather(periodic("a", 0.0), periodic("b", 0.13))
    assert len(wakes["b"]) >= 2
    for tb in wakes["b"]:  # "b" started 0.13 s later, yet woke in the same turns of the loop as "a"
        assert min(abs(tb - ta) for ta in wakes["a"]) < 0.01


async def test_the_wait_ends_on_a_multiple_of_the_interval():
    # the target, not the wake (a loaded machine wakes late): the clock plus the wait is a multiple of the interval
    loop = asyncio.get_running_loop()
    for interval in (0.2, 1.0, 10.0):
        now = loop.time()
        target = now + tick_wait(interval)
        assert min(target % interval, interval - target % interval) < 0.001
        assert target > now


async def test_a_tick_just_passed_is_not_taken_again():
    # a timer fires up to a millisecond early: the tick it woke for is a few milliseconds ahead, and is skipped
    for _ in range(20):
        wait = tick_wait(0.5)
        assert EARLY_S <= wait <= 0.5 + EARLY_S
