"""`duet bench baseline save|check`: the band is the noise the repeats measured, the gate passes on an
unchanged checkout and fails on a build slowed by the documented test knob (DUET_DEBUG_STEP_DELAY_MS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests import baseline

ROOT = Path(__file__).resolve().parents[2]


def _figures(**overrides) -> dict:
    base = {f: {"median": 1.0, "spread": 0.1, "runs": [0.95, 1.0, 1.05]} for f in baseline.FIGURES}
    base.update({f: {"median": m, "spread": s, "runs": []} for f, (m, s) in overrides.items()})
    return {"kinds": {"paged": base}}


def test_a_figure_fails_only_beyond_four_times_the_measured_spread():
    saved = _figures(ttft_p50_s=(0.020, 0.002), output_tok_s=(500.0, 20.0))
    within = _figures(ttft_p50_s=(0.027, 0.001), output_tok_s=(430.0, 10.0))  # 7 ms < 8 ms; 70 < 80 tok/s
    beyond = _figures(ttft_p50_s=(0.029, 0.001), output_tok_s=(410.0, 10.0))  # 9 ms > 8 ms; 90 > 80 tok/s
    verdict = {r["figure"]: r["regressed"] for r in baseline.compare(saved, within)}
    assert not verdict["ttft_p50_s"] and not verdict["output_tok_s"]
    verdict = {r["figure"]: r["regressed"] for r in baseline.compare(saved, beyond)}
    assert verdict["ttft_p50_s"] and verdict["output_tok_s"]
    # better is never a regression, however far: faster TTFT, more tok/s
    better = _figures(ttft_p50_s=(0.001, 0.0), output_tok_s=(5000.0, 0.0))
    assert not any(r["regressed"] for r in baseline.compare(saved, better))


def test_a_noisy_sitting_widens_the_band():
    saved = _figures(tpot_p50_s=(0.003, 0.0005))
    noisy = _figures(tpot_p50_s=(0.006, 0.002))  # 3 ms worse, but this sitting's own spread is 2 ms
    (row,) = [r for r in baseline.compare(saved, noisy) if r["figure"] == "tpot_p50_s"]
    assert row["band"] == baseline.NOISE_FACTOR * 0.002 and not row["regressed"]


def test_the_spread_is_robust_to_one_stalled_run():
    runs = [dict.fromkeys(baseline.FIGURES, v) for v in (0.010, 0.011, 0.009, 0.010, 0.090)]
    s = baseline.summarize(runs)["tpot_p50_s"]
    assert s["median"] == 0.010 and s["spread"] == pytest.approx(0.001)


def test_a_baseline_of_another_model_or_load_is_refused():
    saved = {"format": baseline.FORMAT, "model": "a", "model_config": {}, "load": baseline.LOAD.__dict__}
    assert baseline.comparable(saved, dict(saved)) == []
    assert baseline.comparable(saved, {**saved, "model": "b"}) == ["the baseline's model differs from this run's"]
    assert baseline.comparable(saved, {**saved, "load": {}})


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duet.cli", "bench", "baseline", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, **(env or {})})


def test_save_then_check_passes_unchanged_and_fails_with_the_slowed_build(tmp_path):
    path = tmp_path / "baseline.json"
    saved = _bench("save", str(path))
    assert saved.returncode == 0, saved.stderr[-2000:]
    data = json.loads(path.read_text())
    assert set(data["kinds"]) == {"paged", "prefix"} and data["repeats"] == 5
    assert data["duet_version"] and data["model"] and data["machine"]["cpus"]
    for figures in data["kinds"].values():
        assert figures["output_tok_s"]["median"] > 0 and figures["errors"]["median"] == 0
        assert figures["hit_rate"]["median"] > 0.5  # the shared system prompt is served from cache
        assert len(figures["ttft_p50_s"]["runs"]) == 5

    same = _bench("check", str(path))
    assert same.returncode == 0, same.stdout + same.stderr[-2000:]
    assert "no figure regressed" in same.stdout

    # the test knob: 50 ms of sleep per engine step, many times a tiny model's step (a few ms)
    slow = _bench("check", str(path), env={"DUET_DEBUG_STEP_DELAY_MS": "50"})
    assert slow.returncode == 1, slow.stdout + slow.stderr[-2000:]
    regressed = {tuple(c.strip() for c in line.split("|")[1:3]) for line in slow.stdout.splitlines()
                 if "REGRESSED" in line}
    assert {("paged", "tpot_p50_s"), ("prefix", "tpot_p50_s")} <= regressed, slow.stdout
