"""The ops dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright; no
browser download) against a live stack: it asks for the admin key, its panels fill with data under
traffic, and a weight changed in the page (with its confirmation step) changes the split of the next
400 requests to within 5 points of the new weight; a shadow run shows the primary's and the candidate's figures
side by side. DUET_UPDATE_SCREENSHOT=1 refreshes docs/dashboard.png."""

import asyncio
import os

import httpx
import pytest

from tests.support.dashboard_page import dashboard_page, log_in, needs_chromium
from tests.support.stack import ROOT, LiveStack, Sim, chat_body

KEY = "adm-dashboard"
SCREENSHOT = ROOT / "docs" / "dashboard.png"

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = LiveStack(tmp_path_factory.mktemp("dashboard"), [
        Sim("paged", worker_id="paged-v1", version="v1", ms_per_token=10),
        Sim("paged", worker_id="paged-v2", version="v2", ms_per_token=10),
        Sim("prefix", worker_id="prefix-v1", version="v1", ms_per_token=10),
        Sim("paged", worker_id="paged-v3", version="v3", ms_per_token=10),  # in no variant: the shadow's candidate
    ], admin_key=KEY, routing={"sticky_key": "user", "variants": [
        {"name": "stable", "weight": 90, "pools": [{"engine_kind": "paged", "version": "v1"},
                                                  {"engine_kind": "prefix", "version": "v1"}]},
        {"name": "canary", "weight": 10, "pools": [{"engine_kind": "paged", "version": "v2"}]},
    ]})
    s.start()
    yield s
    s.stop()


async def send(stack, users, concurrency=16, prefix="hello") -> dict[str, int]:
    split: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        async def one(user):
            async with sem:
                r = await c.post("/v1/chat/completions", json=chat_body(stack.model, f"{prefix} from {user}", user, 3))
                assert r.status_code == 200, r.text
                split[r.headers["x-duet-variant"]] = split.get(r.headers["x-duet-variant"], 0) + 1
        await asyncio.gather(*(one(u) for u in users))
    return split


SHARED = "You are the support assistant of a bicycle shop. " * 30


async def mixed_traffic(stack, n: int, concurrency: int = 6) -> None:
    """One-shot prompts (low reuse -> paged) and multi-turn chats over a shared preamble (-> prefix)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        async def one(i):
            async with sem:
                if i % 2:
                    body = chat_body(stack.model, f"one-shot document {i}: " + "lorem ipsum " * (i % 7), f"w{i}", 8)
                else:
                    body = {"model": stack.model, "max_tokens": 8, "user": f"w{i}", "messages": [
                        {"role": "system", "content": SHARED},
                        {"role": "user", "content": "my brakes squeak"},
                        {"role": "assistant", "content": "Which brakes do you have?"},
                        {"role": "user", "content": f"disc brakes, model {i % 5}"}]}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
        await asyncio.gather(*(one(i) for i in range(n)))


async def test_dashboard_live(stack, tmp_path):
    async with dashboard_page(stack.url, height=1500) as (page, errors):
        # it asks for the key; a wrong one is refused
        await log_in(page, "wrong")
        await page.wait_for_selector("#login-error:has-text('refused')")
        await log_in(page, KEY)
        await page.wait_for_selector("#conn:has-text('live')")
        assert await page.evaluate("sessionStorage.getItem('duetAdminKey')") == KEY

        # a canary policy shows on the canary panel
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            r = await c.put(f"/admin/models/{stack.model}/canary-policy", json={
                "canary": "canary", "baseline": "stable", "window_s": 120, "min_requests": 10_000})
            assert r.status_code == 200, r.text
        await page.wait_for_selector("#canary .policy:has-text('automatic rollback: canary vs stable')")

        # panels fill with data under traffic
        traffic = asyncio.create_task(mixed_traffic(stack, 240))
        await page.wait_for_function("Number(document.body.dataset.requests || 0) > 0", timeout=20000)
        await page.wait_for_function(
            "['chart-rps', 'chart-latency', 'chart-tokens'].every(id => Chart.getChart(id).data.datasets"
            ".some(d => d.data.some(v => v > 0)))", timeout=20000)
        await page.wait_for_function("Chart.getChart('chart-reasons').data.labels.length > 0", timeout=20000)
        await page.wait_for_selector("#workers tbody tr >> text=paged-v2")
        assert await page.locator("#workers tbody tr").count() == 4
        await page.wait_for_selector("#decisions tbody tr", timeout=10000)
        # the workload profile's histograms: every request in the prompt-length histogram, the two-turn chats
        # in the session-length one, and their shared preamble as blocks other sessions sent before
        await page.wait_for_function("Number(document.body.dataset.profiled || 0) >= 20", timeout=20000)
        profiled = await page.evaluate("""() => {
            const sum = (id) => Chart.getChart(id).data.datasets[0].data.reduce((a, b) => a + b, 0);
            const turns = Chart.getChart('chart-turns').data;
            const reuse = Chart.getChart('chart-reuse').data;
            return {requests: Number(document.body.dataset.profiled), prompts: sum('chart-prompt-len'),
                    twoTurns: turns.datasets[0].data[turns.labels.indexOf('2')],
                    crossShare: reuse.datasets[0].data[reuse.labels.indexOf("blocks: other sessions'")]};
        }""")
        assert profiled["prompts"] == profiled["requests"] and profiled["twoTurns"] > 0, profiled
        assert profiled["crossShare"] > 10, profiled
        # the peak concurrency beside the mean: the traffic keeps at most 6 requests in flight, and some overlap
        peak = int(await page.evaluate("document.body.dataset.concurrencyPeak"))
        assert 2 <= peak <= 6, peak
        assert f"{peak} at the peak" in await page.text_content("#profile-summary")
        await page.wait_for_timeout(4000)  # a few more seconds of lines on the charts
        # the committed docs/dashboard.png is refreshed only on request, so test runs leave the tree clean
        shot = SCREENSHOT if os.environ.get("DUET_UPDATE_SCREENSHOT") or not SCREENSHOT.exists() \
            else tmp_path / "dashboard.png"
        await page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 50_000
        await traffic

        # change the canary weight in the page, through the confirmation dialog
        model = f"#canary .model[data-model='{stack.model}']"
        await page.fill(f"{model} input[data-variant='stable']", "70")
        await page.fill(f"{model} input[data-variant='canary']", "30")
        await page.click(f"{model} button.apply")
        await page.wait_for_selector("#confirm[open]")
        assert "canary: 10 -> 30" in await page.inner_text("#confirm-body")
        await page.click("#confirm-ok")
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            for _ in range(50):
                cfg = (await c.get(f"/admin/models/{stack.model}/routing")).json()
                if cfg["variants"][1]["weight"] == 30:
                    break
                await asyncio.sleep(0.1)
            assert [v["weight"] for v in cfg["variants"]] == [70, 30]
            audit = (await c.get("/admin/audit?limit=1")).json()["entries"][0]
            assert audit["actor"].startswith("admin-") and audit["after"]["variants"][1]["weight"] == 30
        await page.wait_for_selector("#audit tbody tr >> text=canary=30", timeout=10000)

        split = await send(stack, [f"user-{i}" for i in range(400)], prefix="after the change")
        share = 100 * split.get("canary", 0) / 400
        assert abs(share - 30) <= 5, split

        # drain a worker from the page: confirmed, shown as draining, and new requests avoid it
        await page.click("#workers tbody tr:has-text('prefix-v1') button.drain")
        await page.wait_for_selector("#confirm[open]")
        await page.click("#confirm-ok")
        await page.wait_for_selector("#workers tbody tr:has-text('prefix-v1') >> text=draining", timeout=5000)
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
            for i in range(10):
                body = {"model": stack.model, "max_tokens": 2, "user": f"d{i}", "messages": [
                    {"role": "system", "content": SHARED}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": f"again {i}"}]}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.headers["x-duet-worker"] != "prefix-v1"

        # a shadow run: the candidate (paged-v3, weight 0) beside the primary, per class, with its verdict
        await page.wait_for_selector("#shadow:has-text('no shadow running')")
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            path = f"/admin/models/{stack.model}"
            cfg = (await c.get(f"{path}/routing")).json()
            cfg["variants"].append({"name": "candidate", "weight": 0,
                                    "pools": [{"engine_kind": "paged", "version": "v3"}]})
            assert (await c.put(f"{path}/routing", json=cfg)).status_code == 200
            r = await c.put(f"{path}/shadow", json={
                "pools": [{"engine_kind": "paged", "version": "v3"}], "share": 1, "max_loop_lag_ms": 1000,
                "gates": {"min_requests": 5, "max_ttft_p50_ratio": None, "max_ttft_p99_ratio": None,
                          "max_tpot_p50_ratio": None, "max_tpot_p99_ratio": None,
                          "max_error_rate_increase": None}})  # only greedy agreement left to wait for
            assert r.status_code == 200, r.text
        await send(stack, [f"shadowed-{i}" for i in range(20)], concurrency=4, prefix="mirrored")
        model = f"#shadow .model[data-model='{stack.model}']"
        await page.wait_for_function(
            f"() => {{ const row = document.querySelector(\"{model} tr[data-class='all']\"); if (!row) return false;"
            " return Number(row.querySelector('.primary').textContent) >= 5"
            " && Number(row.querySelector('.candidate').textContent) >= 5; }", timeout=20000)
        assert await page.locator(f"{model} tr[data-class='oneshot']").count() == 1
        assert "candidate paged@v3" in await page.inner_text(model)
        # no greedy request was sent: the verdict waits for greedy pairs to compare
        await page.wait_for_selector(f"{model} .verdict:has-text('greedy answers compared')")
        assert not errors, errors
