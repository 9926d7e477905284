"""The ops dashboard in a real headless Chromium for the browser tests (tests/dashboard): Debian's
/usr/bin/chromium driven by Playwright (no browser download), a skip mark for machines without it, and
`dashboard_page`, a page open on a stack's /dashboard that collects the page's JavaScript errors.

    async with dashboard_page(stack.url, height=1200) as (page, errors):
        await log_in(page, KEY)
        ...
        assert not errors, errors
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium package")


@contextlib.asynccontextmanager
async def dashboard_page(url: str, height: int):
    """(page, errors): a 1400 x `height` page on `url`/dashboard; `errors` fills with the page's uncaught
    JavaScript errors. The browser is closed on the way out, whatever the test did."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                          args=["--no-sandbox", "--disable-gpu"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": height})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(url + "/dashboard")
            yield page, errors
        finally:
            await browser.close()


async def log_in(page, key: str) -> None:
    """Types the admin key into the dashboard's login form and sends it."""
    await page.fill("#admin-key", key)
    await page.click("#login-form button")
