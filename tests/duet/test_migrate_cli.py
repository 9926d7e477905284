"""`duet migrate` refuses what it cannot do before it calls anything, in words a user can act on (the steps
themselves run against a live stack in tests/gateway/test_shadow_live.py)."""

import pytest

from duet.cli import main


def test_no_admin_key_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.delenv("DUET_ADMIN_KEY", raising=False)
    assert main(["migrate", "status", "--gateway", "http://127.0.0.1:9"]) == 1
    assert "duet migrate status: the admin key is required: --admin-key or DUET_ADMIN_KEY" in capsys.readouterr().err


def test_an_unreachable_gateway_is_named(capsys):
    assert main(["migrate", "plan", "--gateway", "http://127.0.0.1:9", "--admin-key", "k"]) == 1
    assert "GET /admin/workers: the gateway did not answer" in capsys.readouterr().err


def test_bad_pools_and_ramps_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["migrate", "shadow", "--candidate", "@v2", "--admin-key", "k"])
    assert e.value.code == 2 and "a pool is KIND@VERSION" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["migrate", "canary", "--ramp", "10:60,fast", "--admin-key", "k"])
    assert e.value.code == 2 and "a ramp is WEIGHT:HOLD_S" in capsys.readouterr().err
