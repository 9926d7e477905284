"""Per-key cache_salt end to end on both real engines (tiny model, CPU): tenant B never gets
cached_tokens from tenant A's prompt, while each tenant does reuse its own (both engines have a prefix
cache: engine_prefix's radix tree, engine_paged's automatic prefix caching)."""

from __future__ import annotations

import httpx
import pytest

from loadtests.stack.serving import ADMIN_KEY, ServingStack
from tests.support.stack import model_dir

MODEL = model_dir().name
ROUTING = {"variants": [{"name": "p", "weight": 1, "pools": [{"engine_kind": "paged"}]},
                        {"name": "x", "weight": 1, "pools": [{"engine_kind": "prefix"}]}]}
AUTH = {"admin_key": ADMIN_KEY, "api_keys": [{"key": "sk-a", "cache_salt": "tenant-a"},
                                             {"key": "sk-b", "cache_salt": "tenant-b"}]}


def _cached(url: str, key: str, variant: str, prompt: str) -> tuple[str, int]:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}", "x-duet-variant": variant, "x-duet-admin-key": ADMIN_KEY},
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return r.headers["x-duet-engine"], details.get("cached_tokens", 0)


@pytest.mark.timeout(600)
def test_tenant_b_never_reuses_tenant_a_s_cache_on_either_engine(tmp_path):
    with ServingStack(model_dir(), ["paged", "prefix"], ROUTING, log_dir=tmp_path,
                      gateway_extra={"auth": AUTH}) as stack:
        for variant, engine in (("x", "prefix"), ("p", "paged")):
            prompt = f"{engine} tenant test: " + " ".join(f"word{i}" for i in range(120))
            assert _cached(stack.url, "sk-a", variant, prompt) == (engine, 0)
            _, a_again = _cached(stack.url, "sk-a", variant, prompt)
            _, b_first = _cached(stack.url, "sk-b", variant, prompt)
            _, b_again = _cached(stack.url, "sk-b", variant, prompt)
            assert b_first == 0, f"{engine}: tenant B got {b_first} cached tokens from tenant A's prompt"
            # the salt separates tenants; it does not switch caching off
            assert a_again >= 64 and b_again >= 64, f"{engine}: {a_again}, {b_again}"
