"""The gateway config file: what an operator writes, what they get told when it is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, from_dict, load

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_in_deploy_loads(monkeypatch):
    monkeypatch.delenv("DUET_API_KEYS", raising=False)
    monkeypatch.delenv("DUET_ADMIN_KEY", raising=False)
    c = load(ROOT / "deploy" / "gateway.yaml")
    assert c.workers and c.redis
    assert not c.api_keys and c.admin_key is None  # keys come from the environment, never from deploy/
    assert [v.name for v in c.routing.variants] == ["stable", "canary"]


def test_environment_keys_are_merged(monkeypatch):
    monkeypatch.setenv("DUET_API_KEYS", "k1,k2")
    monkeypatch.setenv("DUET_ADMIN_KEY", "adm")
    c = from_dict({"auth": {"api_keys": ["k0"], "admin_key": "file-admin"}})
    assert set(c.api_keys) == {"k0", "k1", "k2"} and c.admin_key == "adm"
    monkeypatch.setenv("DUET_REDIS_URL", "redis://:pw@state:6379/1")
    assert from_dict({"redis": "redis://other:6379/0"}).redis == "redis://:pw@state:6379/1"


@pytest.mark.parametrize("raw, words", [
    ({"limits": {"max_body": 1}}, "limits: unknown keys ['max_body']"),
    ({"workers": ["no-port"]}, "host:port"),
    ({"routing": {"reuse_threshold": 2}}, "reuse_threshold"),
    ({"auth": {"api_keys": [3]}}, "api_keys"),
    ({"port": "eighty"}, "eighty"),
])
def test_bad_config_says_what_is_wrong(raw, words):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert words in str(e.value)


def test_duet_gateway_exits_2_with_the_reason(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text("models: [{path: /no/such/model}]\n")
    r = subprocess.run([sys.executable, "-m", "duet.cli", "gateway", "--config", str(bad)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, check=False)
    assert r.returncode == 2 and "/no/such/model" in r.stderr
