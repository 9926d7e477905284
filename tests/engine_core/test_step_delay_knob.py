"""DUET_DEBUG_STEP_DELAY_MS, the test knob that slows a build on purpose (the upgrade gate's test)."""

import pytest

from engine_core.step_loop import DEBUG_STEP_DELAY_ENV, debug_step_delay_s


def test_unset_is_no_delay_and_milliseconds_are_read(monkeypatch):
    monkeypatch.delenv(DEBUG_STEP_DELAY_ENV, raising=False)
    assert debug_step_delay_s() == 0.0
    monkeypatch.setenv(DEBUG_STEP_DELAY_ENV, "25")
    assert debug_step_delay_s() == 0.025


@pytest.mark.parametrize("bad", ["fast", "-1", "1e9"])
def test_a_bad_value_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv(DEBUG_STEP_DELAY_ENV, bad)
    with pytest.raises(ValueError, match=DEBUG_STEP_DELAY_ENV):
        debug_step_delay_s()
