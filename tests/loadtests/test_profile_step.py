"""loadtests/profiles/profile_step.py's `--panel-rows-against`: the decode steps alternate the two row limits of
duet::cpu_linear's AMX panels in one process, the ratio is the pairs' median, and the engine's own limit is back
afterwards."""

from __future__ import annotations

from engine_core import cpu_linear
from loadtests.profiles import profile_step


def test_panel_rows_ab_alternates_the_limits_and_restores_the_default(monkeypatch):
    default = cpu_linear.PANEL_ROWS
    seen = []
    monkeypatch.setattr(profile_step, "run_step", lambda *a: seen.append(cpu_linear.PANEL_ROWS))
    # start and end of each step: the default side's steps take 1 s, the other side's 2 s
    ticks = iter([0, 1, 1, 3, 3, 4, 4, 6, 6, 7, 7, 9])
    result = profile_step.panel_rows_ab(None, None, [], [], steps=3, against=0, clock=lambda: float(next(ticks)))
    assert seen == [default, 0] * 3
    assert cpu_linear.PANEL_ROWS == default
    assert result == {"panel_rows": default, "against": 0, "ratio": 0.5}
