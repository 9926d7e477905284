"""Two gateways sharing one real Redis: a weight change made through one's admin API is what the other
routes with within a second, and both show the audit entry."""

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from test_admin import AUTH, GOOD, KEY, Backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import LiveStack, Sim, chat_body

from gateway.control.admin import admin_routes, key_id
from gateway.control.state.redis_store import RedisStore


async def test_weight_change_reaches_the_other_gateway_within_a_second(clean_redis_url):
    a, b = Backend(), Backend()
    a.state, b.state = RedisStore(clean_redis_url), RedisStore(clean_redis_url)
    await a.state.start()
    await b.state.start()
    try:
        apps = [Starlette(routes=admin_routes(x)) for x in (a, b)]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[0]), base_url="http://a") as ca, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[1]), base_url="http://b") as cb:
            assert (await ca.put("/admin/models/m/routing", json=GOOD, headers=AUTH)).status_code == 200
            await _until(lambda: cb.get("/admin/models/m/routing", headers=AUTH), lambda body: body["variants"])

            changed = json.loads(json.dumps(GOOD))
            changed["variants"][0]["weight"], changed["variants"][1]["weight"] = 50, 50
            t0 = time.monotonic()
            assert (await ca.put("/admin/models/m/routing", json=changed, headers=AUTH)).status_code == 200
            await _until(lambda: cb.get("/admin/models/m/routing", headers=AUTH),
                         lambda body: body["variants"][1]["weight"] == 50)
            assert time.monotonic() - t0 < 1.0
            # what B routes with (its StateStore), not only what its admin API prints
            assert [v.weight for v in (await b.state.get_routing("m")).variants] == [50.0, 50.0]

            entries = (await cb.get("/admin/audit", headers=AUTH)).json()["entries"]
            assert entries[0]["actor"] == key_id(KEY)
            assert entries[0]["after"]["variants"][1]["weight"] == 50
    finally:
        await a.state.close()
        await b.state.close()


async def _until(get, ok, timeout_s=1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        r = await get()
        if r.status_code == 200 and ok(r.json()):
            return
        assert time.monotonic() < deadline, f"not seen within {timeout_s}s: {r.text}"
        await asyncio.sleep(0.02)


async def test_two_gateway_processes_route_by_a_change_made_on_one(clean_redis_url, tmp_path):
    """Real `duet gateway` processes: flip all traffic to the canary on A; B routes there within 1 s."""
    stack = LiveStack(tmp_path, [Sim("paged", worker_id="stable", version="v1"), Sim("paged", worker_id="canary", version="v2")],
                      admin_key=KEY, redis_url=clean_redis_url, gateways=2)
    stack.start()
    try:
        a, b = stack.urls
        model = stack.model
        flip = {"sticky_key": "user", "variants": [
            {"name": "stable", "weight": 0, "pools": [{"engine_kind": "paged", "version": "v1"}]},
            {"name": "canary", "weight": 100, "pools": [{"engine_kind": "paged", "version": "v2"}]}]}
        async with httpx.AsyncClient(timeout=10) as c:
            body = chat_body(model, "which arm am I in?", "the-user", 2)
            r = await c.post(b + "/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers["x-duet-variant"] == "default"
            t0 = time.monotonic()
            r = await c.put(f"{a}/admin/models/{model}/routing", json=flip, headers=AUTH)
            assert r.status_code == 200, r.text
            while True:
                r = await c.post(b + "/v1/chat/completions", json=body)
                if r.headers.get("x-duet-variant") == "canary":
                    break
                assert time.monotonic() - t0 < 1.0, "gateway B still routes by the old config after 1 s"
                await asyncio.sleep(0.02)
            assert r.headers["x-duet-worker"] == "canary"
            entries = (await c.get(b + "/admin/audit", headers=AUTH)).json()["entries"]
            assert entries[0]["actor"] == key_id(KEY) and entries[0]["after"]["variants"][1]["weight"] == 100
    finally:
        stack.stop()
