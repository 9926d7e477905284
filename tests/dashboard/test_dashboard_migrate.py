"""The migrate path from the dashboard, in a real headless Chromium against a live stack: start a shadow from the
page (its routing variant of weight 0 written first, through the confirmation step), a canary refused while the
shadow's gates wait for data, then started once they pass; stop the shadow."""

import json

import httpx
import pytest

from tests.support.dashboard_page import dashboard_page, log_in, needs_chromium
from tests.support.stack import LiveStack, Sim, chat_body

KEY = "adm-migrate"
# only the request count is gated: the sims' figures are not what this test is about
EXTRA = {"max_loop_lag_ms": 1000, "gates": {"min_requests": 3, "max_ttft_p50_ratio": None, "max_ttft_p99_ratio": None,
                                            "max_tpot_p50_ratio": None, "max_tpot_p99_ratio": None,
                                            "max_error_rate_increase": None, "min_greedy_agreement": None}}

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = LiveStack(tmp_path_factory.mktemp("migrate"), [
        Sim("paged", worker_id="paged-v1", version="v1", ms_per_token=5),
        Sim("paged", worker_id="paged-v3", version="v3", ms_per_token=5),
    ], admin_key=KEY)
    s.start()
    yield s
    s.stop()


async def test_shadow_then_gated_canary_from_the_page(stack):
    path = f"/admin/models/{stack.model}"
    async with dashboard_page(stack.url, height=1200) as (page, errors):
        await log_in(page, KEY)
        await page.wait_for_selector(f"#migrate-model option[value='{stack.model}']", state="attached")

        # a pool no worker is in is refused in the page, before anything is written
        await page.fill("#migrate-candidate", "prefix@v9")
        await page.click("#shadow-form button")
        await page.wait_for_selector("#migrate-status:has-text('is in prefix@v9')")

        await page.fill("#migrate-candidate", "paged@v3")
        await page.fill("#migrate-share", "1")
        await page.fill("#migrate-extra", json.dumps(EXTRA))
        await page.click("#shadow-form button")
        await page.wait_for_selector("#confirm[open]")
        assert "variant candidate (paged@v3) at weight 0" in await page.inner_text("#confirm-body")
        await page.click("#confirm-ok")
        await page.wait_for_selector("#migrate-status:has-text('shadow started: 100%')")
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            routing = (await c.get(f"{path}/routing")).json()
            assert {v["name"]: v["weight"] for v in routing["variants"]} == {"primary": 100, "candidate": 0}
            config = (await c.get(f"{path}/shadow")).json()["shadow"]["config"]
            assert config["share"] == 1 and config["gates"]["min_requests"] == 3

        # the canary is refused while the gates wait for data, and says why
        shadow = f"#shadow .model[data-model='{stack.model}']"
        await page.click(f"{shadow} button.start-canary")
        await page.wait_for_selector("#confirm[open]")
        await page.click("#confirm-ok")
        await page.wait_for_selector("#migrate-status:has-text('refused')")
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            assert (await c.get(f"{path}/canary-policy")).json()["policy"] is None

        # traffic: every request mirrored to paged-v3, answered by paged-v1; then the gates pass
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
            for i in range(6):
                r = await c.post("/v1/chat/completions", json=chat_body(stack.model, f"question {i}", f"u{i}", 3))
                assert r.status_code == 200 and r.headers["x-duet-worker"] == "paged-v1", r.text
        await page.wait_for_selector(f"{shadow} .verdict:has-text('gates passed')", timeout=20000)
        await page.click(f"{shadow} button.start-canary")
        await page.wait_for_selector("#confirm[open]")
        await page.click("#confirm-ok")
        await page.wait_for_selector("#migrate-status:has-text('canary started: candidate ramps')")
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            policy = (await c.get(f"{path}/canary-policy")).json()["policy"]
            assert policy["canary"] == "candidate" and policy["baseline"] == "primary"

        # stop the shadow from the page
        await page.click(f"{shadow} button.stop-shadow")
        await page.wait_for_selector("#confirm[open]")
        await page.click("#confirm-ok")
        await page.wait_for_selector("#shadow:has-text('no shadow running')", timeout=10000)
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.admin_headers) as c:
            assert (await c.get(f"{path}/shadow")).json()["shadow"] is None
        assert not errors, errors
