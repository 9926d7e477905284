"""Automatic rollback on a live stack: `duet engine sim` workers behind a real gateway process.
A healthy canary keeps its weight; a slow one (TTFT far above the baseline) is rolled back to 0,
audited, counted in /metrics and listed on the stream the dashboard reads."""

import asyncio
import json
import re
import time
import uuid

import httpx
import pytest

from tests.support.stack import LiveStack, Sim, chat_body

KEY = "adm-rollback"


def routing(canary_version: str, canary_weight: float = 50) -> dict:
    return {"sticky_key": "user", "variants": [
        {"name": "stable", "weight": 100 - canary_weight, "pools": [{"engine_kind": "paged", "version": "v1"}]},
        {"name": "canary", "weight": canary_weight, "pools": [{"engine_kind": "paged", "version": canary_version}]},
    ]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = LiveStack(tmp_path_factory.mktemp("rollback"), [
        Sim("paged", worker_id="stable", version="v1"),
        Sim("paged", worker_id="canary-ok", version="v2"),
        # slow prefill: ~15 ms per uncached prompt token, so TTFT is far above the baseline's
        Sim("paged", worker_id="canary-slow", version="v3", prefill_ms_per_token=15.0),
        Sim("paged", worker_id="canary-fail", version="v4", fail_rate=1.0),
    ], admin_key=KEY, routing=routing("v2"))
    s.start()
    yield s
    s.stop()


async def traffic(stack, n: int, concurrency: int = 8) -> dict[str, int]:
    variants: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        async def one(i):
            async with sem:
                # distinct prompts: nothing is served from the sims' prefix caches
                body = chat_body(stack.model, f"{uuid.uuid4().hex} question {i} about canaries", f"u{i}", 2)
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                v = r.headers["x-duet-variant"]
                variants[v] = variants.get(v, 0) + 1
        await asyncio.gather(*(one(i) for i in range(n)))
    return variants


async def canary_weight(c, stack) -> float:
    r = await c.get(f"/admin/models/{stack.model}/routing", headers=stack.admin_headers)
    return {v["name"]: v["weight"] for v in r.json()["variants"]}["canary"]


async def test_healthy_canary_keeps_its_weight_and_slow_one_is_rolled_back(stack):
    policy = {"canary": "canary", "baseline": "stable", "window_s": 6, "min_requests": 8,
              "max_ttft_p99_ratio": 3.0, "max_error_rate_increase": 0.2, "confirm_s": 1}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        r = await c.put(f"/admin/models/{stack.model}/canary-policy", json=policy, headers=stack.admin_headers)
        assert r.status_code == 200, r.text

        # healthy canary: enough traffic for a verdict, ticks pass, weight stays
        split = await traffic(stack, 60)
        assert split.get("canary", 0) >= 8 and split.get("stable", 0) >= 8
        await asyncio.sleep(2.5)
        assert await canary_weight(c, stack) == 50

        # the same canary arm now served by the slow workers
        r = await c.put(f"/admin/models/{stack.model}/routing", json=routing("v3"), headers=stack.admin_headers)
        assert r.status_code == 200, r.text
        await asyncio.sleep(7)  # let the healthy samples leave the window
        await traffic(stack, 60)
        deadline = time.monotonic() + 15
        while await canary_weight(c, stack) != 0:
            assert time.monotonic() < deadline, f"no rollback:\n{stack.logs()}"
            await asyncio.sleep(0.25)

        audit = (await c.get("/admin/audit?limit=5", headers=stack.admin_headers)).json()["entries"]
        assert audit[0]["actor"].startswith("automatic rollback: TTFT p99 ")
        assert audit[0]["actor"].endswith("x baseline over 6 s")
        assert {v["name"]: v["weight"] for v in audit[0]["after"]["variants"]} == {"stable": 50, "canary": 0}

        metrics = (await c.get("/metrics")).text
        assert f'duet_canary_rollbacks_total{{model="{stack.model}",variant="canary"}} 1.0' in metrics

        # the dashboard's stream shows the event
        async with c.stream("GET", "/admin/stats/stream", headers=stack.admin_headers) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    break
        assert event["rollback"]["events"][-1]["message"].startswith("automatic rollback")
        assert event["rollback"]["status"][stack.model]["rolled_back"]

        # and new traffic all goes to the baseline
        assert set(await traffic(stack, 20)) == {"stable"}


async def test_failing_canary_is_rolled_back(stack):
    policy = {"canary": "canary", "baseline": "stable", "window_s": 6, "min_requests": 5,
              "max_ttft_p99_ratio": None, "max_error_rate_increase": 0.2, "confirm_s": 1}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        r = await c.put(f"/admin/models/{stack.model}/routing", json=routing("v4"), headers=stack.admin_headers)
        assert r.status_code == 200, r.text
        r = await c.put(f"/admin/models/{stack.model}/canary-policy", json=policy, headers=stack.admin_headers)
        assert r.status_code == 200, r.text
        await traffic(stack, 40)  # the gateway retries the failures on the baseline: clients see no error
        deadline = time.monotonic() + 10
        while await canary_weight(c, stack) != 0:
            assert time.monotonic() < deadline, "no rollback of a canary failing every request"
            await asyncio.sleep(0.25)
        audit = (await c.get("/admin/audit?limit=1", headers=stack.admin_headers)).json()["entries"]
        # the window may still hold the previous test's healthy canary requests, so the rate is not 100%
        assert re.fullmatch(r"automatic rollback: error rate \d+% vs baseline 0% over 6 s", audit[0]["actor"])
