"""The migration path end to end on a local stack: real engine workers (engine_paged on the tiny model, real
gRPC), a gateway process with its state in a real Redis, driven by `duet migrate` itself.

A shadow of a candidate slowed on purpose (DUET_DEBUG_STEP_DELAY_MS) fails its gates: `duet migrate canary`
exits 1 with the failed bounds, the admin API refuses the canary start and any routing change that would give
the candidate traffic (409 shadow_gate_failed), and no canary starts. Meanwhile every user's answer came from
the primary. A healthy candidate passes; the canary then ramps under the rollback controller and is promoted,
after which the candidate serves every request."""

import asyncio
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.support.stack import ROOT, Engine, LiveStack

KEY = "adm-shadow"
# wide bounds (the machine is shared: a healthy copy measured up to 2x the primary here); the slowed candidate
# sleeps 300 ms after every step, tens of times past them
GATES = '{"min_requests": 10, "max_ttft_p50_ratio": 5, "max_ttft_p99_ratio": null, "max_tpot_p50_ratio": 5, ' \
        '"max_tpot_p99_ratio": null, "max_error_rate_increase": 0.1, "min_greedy_agreement": 0.8, ' \
        '"min_greedy_compared": 5}'


@pytest.fixture
def stack(tmp_path, clean_redis_url):
    s = LiveStack(tmp_path, [
        Engine("paged", worker_id="paged-v1", version="v1"),
        Engine("paged", worker_id="paged-v2", version="v2"),
        Engine("paged", worker_id="paged-slow", version="v3", env={"DUET_DEBUG_STEP_DELAY_MS": "300"}),
    ], admin_key=KEY, redis_url=clean_redis_url, routing={"variants": [
        {"name": "primary", "weight": 100, "pools": [{"engine_kind": "paged", "version": "v1"}]}]})
    s.start(timeout_s=240)
    yield s
    s.stop()


def migrate(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duet.cli", "migrate", *args, "--gateway", stack.url,
                           "--admin-key", KEY], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


async def traffic(stack, n: int, concurrency: int = 2) -> dict[str, int]:
    """`n` greedy chats with distinct prompts; the workers that answered, by id."""
    served: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        async def one(i):
            async with sem:
                body = {"model": stack.model, "temperature": 0, "max_tokens": 6, "user": f"u{i}",
                        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} question {i}"}]}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                served[r.headers["x-duet-worker"]] = served.get(r.headers["x-duet-worker"], 0) + 1
        await asyncio.gather(*(one(i) for i in range(n)))
    return served


async def shadow_report(c, stack, until, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        report = (await c.get(f"/admin/models/{stack.model}/shadow")).json()["shadow"]
        if until(report) or time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.5)


async def test_slow_candidate_is_refused_and_healthy_one_ramps_and_promotes(stack):
    plan = migrate(stack, "plan")
    assert plan.returncode == 0, plan.stderr
    assert "pool paged@v3: 1 workers" in plan.stdout and "variant primary: weight 100" in plan.stdout

    # the slowed candidate: its pools get a variant of weight 0, then a copy of every request
    out = migrate(stack, "shadow", "--candidate", "paged@v3", "--share", "1", "--max-concurrency", "16",
                  "--window-s", "120", "--max-loop-lag-ms", "1000", "--gates", GATES)
    assert out.returncode == 0, out.stderr
    assert "shadow started" in out.stdout
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers, timeout=30) as c:
        routing = (await c.get(f"/admin/models/{stack.model}/routing")).json()
        assert {v["name"]: v["weight"] for v in routing["variants"]} == {"primary": 100, "candidate": 0}

        served = await traffic(stack, 30)
        assert served == {"paged-v1": 30}  # the shadow answers nobody
        report = await shadow_report(c, stack, lambda r: r["shadow"]["requests"] >= 10 and r["in_flight"] == 0)
        assert report["primary"]["requests"] >= 10 and report["shadow"]["requests"] >= 10, report
        assert not report["verdict"]["passed"]
        assert any(f.startswith(("TTFT p50", "TPOT p50")) for f in report["verdict"]["failures"]), report["verdict"]

        out = migrate(stack, "canary", "--ramp", "50:2,100:2")
        assert out.returncode == 1
        assert "409" in out.stderr and "fails its gates" in out.stderr, out.stderr
        r = await c.post(f"/admin/models/{stack.model}/canary/start")
        assert r.status_code == 409 and r.json()["error"]["code"] == "shadow_gate_failed"
        more = {**routing, "variants": [{**v, "weight": 10 if v["name"] == "candidate" else 90}
                                        for v in routing["variants"]]}
        r = await c.put(f"/admin/models/{stack.model}/routing", json=more)
        assert r.status_code == 409 and "TPOT p50" in r.json()["error"]["message"]
        assert (await c.get(f"/admin/models/{stack.model}/canary-policy")).json()["policy"] is None
        routing = (await c.get(f"/admin/models/{stack.model}/routing")).json()
        assert {v["name"]: v["weight"] for v in routing["variants"]} == {"primary": 100, "candidate": 0}

        # a healthy candidate: the same steps pass
        out = migrate(stack, "shadow", "--candidate", "paged@v2", "--share", "1", "--max-concurrency", "16",
                      "--window-s", "120", "--max-loop-lag-ms", "1000", "--gates", GATES)
        assert out.returncode == 0, out.stderr
        assert await traffic(stack, 30) == {"paged-v1": 30}
        report = await shadow_report(c, stack, lambda r: r["verdict"]["passed"])
        assert report["verdict"]["passed"], report
        assert report["shadow"]["greedy_agreement"] >= 0.8
        status = migrate(stack, "status")
        assert "gates: passed" in status.stdout and "next: `duet migrate canary`" in status.stdout, status.stdout

        # the rollback watches the shadow's gates on the live arms; its own TTFT p99 bound is widened, as a few
        # requests' p99 on a shared machine is one request's stall
        out = migrate(stack, "canary", "--ramp", "50:2,100:2", "--min-requests", "5", "--confirm-s", "1",
                      "--max-ttft-p99-ratio", "10")
        assert out.returncode == 0, out.stderr
        assert "canary started: candidate ramps 50% -> 100% against primary" in out.stdout

        # traffic through the ramp until the controller promotes the candidate
        served, deadline = {}, time.monotonic() + 60
        while time.monotonic() < deadline:
            for worker, count in (await traffic(stack, 6)).items():
                served[worker] = served.get(worker, 0) + count
            if (await c.get(f"/admin/models/{stack.model}/canary-policy")).json()["promoted"]:
                break
        policy = (await c.get(f"/admin/models/{stack.model}/canary-policy")).json()
        assert policy["promoted"] and not policy["rolled_back"], (policy, served)
        assert served.get("paged-v2", 0) > 0 and served.get("paged-v1", 0) > 0, served  # both arms served
        routing = (await c.get(f"/admin/models/{stack.model}/routing")).json()
        assert {v["name"]: v["weight"] for v in routing["variants"]} == {"primary": 0, "candidate": 100}
        audit = [e.get("actor") for e in (await c.get("/admin/audit?limit=10")).json()["entries"]]
        assert any(str(a).startswith("canary promoted") for a in audit), audit
        assert await traffic(stack, 8) == {"paged-v2": 8}
    status = migrate(stack, "status")
    assert "promoted" in status.stdout, status.stdout
