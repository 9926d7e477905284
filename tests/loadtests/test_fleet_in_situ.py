"""The fleet validation's in-situ step factors (loadtests/sim/calibrate/in_situ.py), the held-out trace window
they are measured on, and the simulated gateway poll's phases (loadtests/sim/fleet/validate.py)."""

from __future__ import annotations

import json
import statistics

import pytest

from loadtests.sim.calibrate.in_situ import START_S, in_situ_factors
from loadtests.sim.fleet.cost_models import InSituCostModel, LinearCostModel, StepShape
from loadtests.sim.fleet.gateway_path import GatewayPath

FIT = LinearCostModel("cpu", intercept_s=0.05, per_prefill_token_s=0.001, per_decode_token_s=0.0,
                      per_attended_pair_s=0.0, per_row_s=0.002)


def test_factors_are_the_idle_neighbour_medians_and_the_busy_excess_over_them():
    # (kind, neighbour busy, forward s, fit s, step s)
    rows = {1: [("decode", False, 1.2, 1.0, 1.2), ("decode", False, 1.1, 1.0, 1.1), ("decode", False, 1.3, 1.0, 1.3),
                ("decode", True, 1.32, 1.0, 1.32)],
            2: [("prefill", False, 3.0, 2.0, 3.0), ("prefill", True, 3.3, 2.0, 3.3), ("mixed", True, 0.5, 0.5, 0.5)]}
    got = in_situ_factors(rows)
    assert got["decode"] == 1.2 and got["prefill"] == 1.5
    assert got["mixed"] == 1.0  # no step ran alone: all its steps
    # busy steps over their kind's factor: 1.32 / 1.2 = 1.1, 3.3 / 2 / 1.5 = 1.1, 1.0 / 1.0 -> median 1.1
    assert got["neighbour_slowdown"] == pytest.approx(0.1)
    assert got["steps"] == {"prefill": 2, "decode": 4, "mixed": 1} and got["steps_with_neighbour_busy"] == 3


def test_a_kind_never_traced_keeps_the_fit():
    assert in_situ_factors({1: [("decode", False, 2.0, 1.0, 2.0)]})["prefill"] == 1.0


def test_the_in_situ_model_scales_each_step_by_its_kind(tmp_path):
    model = InSituCostModel(FIT, prefill=1.5, decode=1.2, mixed=1.1)
    prefill = StepShape(512, 0, 512, 0, 1, 0)
    decode = StepShape(0, 16, 16 * 600, 0, 16, 16 * 600)
    mixed = StepShape(256, 8, 2000, 0, 9, 1000)
    for shape, factor in ((prefill, 1.5), (decode, 1.2), (mixed, 1.1)):
        assert model.step_seconds(shape) == pytest.approx(FIT.step_seconds(shape) * factor)
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"coefficients": {"intercept_s": 0.05, "per_prefill_token_s": 0.001,
                                                "per_decode_token_s": 0.0, "per_attended_pair_s": 0.0}}))
    assert InSituCostModel.from_json(fit) is None  # not measured: --validate uses the fit alone
    fit.write_text(json.dumps({**json.loads(fit.read_text()),
                               "in_situ": {"prefill": 1.5, "decode": 1.2, "mixed": 1.1, "neighbour_slowdown": 0.02}}))
    assert InSituCostModel.from_json(fit).step_seconds(prefill) == pytest.approx(0.562 * 1.5)


def test_the_held_out_window_shares_no_request_with_the_validation_and_has_its_shape():
    from loadtests.sim.fleet.validate import ValidateSettings
    from loadtests.sim.fleet.workload import MIXES, WorkloadError, build

    s = ValidateSettings()

    def window(start):
        return build(MIXES["mixed"], s.window_s, s.rate, 2048, max_output_tokens=s.max_output_tokens,
                     max_prompt_tokens=s.max_prompt_tokens, start_s=start)

    validation, held_out = window(0.0), window(START_S)
    assert not {r.request_id for r in validation} & {r.request_id for r in held_out}
    assert held_out[0].arrival_s >= 0 and held_out[-1].arrival_s < s.window_s / s.rate  # timed from its start
    for source in ("mooncake", "azure_code"):  # each source's records from START_S trace seconds on
        first = min(r.record.timestamp_ms for r in validation if r.request_id.startswith(source))
        assert min(r.record.timestamp_ms for r in held_out if r.request_id.startswith(source)) >= first + START_S * 1000
    for cls in ("chat", "document"):
        a = sum(r.traffic_class == cls for r in validation)
        b = sum(r.traffic_class == cls for r in held_out)
        assert abs(a - b) <= 0.1 * a, (cls, a, b)  # the same mix of turns and documents
    with pytest.raises(WorkloadError, match="start >= 0"):
        window(-1.0)


def test_a_negative_poll_phase_is_a_clear_error():
    with pytest.raises(ValueError, match="poll_phase_s"):
        GatewayPath(poll_interval_s=0.5, poll_phase_s=-0.1)


def test_validate_reports_the_median_over_the_poll_phases():
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.validate import POLL_PHASES, ValidateSettings, poll_phases, simulated
    from loadtests.sim.fleet.workload import MIXES, build

    phases = poll_phases()
    assert len(phases) == POLL_PHASES and phases == sorted(phases) and 0 < phases[0] and phases[-1] < 0.5
    s = ValidateSettings(window_s=12.0)
    requests = build(MIXES["mixed"], s.window_s, s.rate, EngineProfile.for_cost_model("cpu").max_model_len,
                     max_output_tokens=s.max_output_tokens, max_prompt_tokens=s.max_prompt_tokens)
    figures = simulated(requests, s)
    assert [r["poll_phase_s"] for r in figures["by_poll_phase"]] == phases
    for key in ("goodput_rps", "ttft_p50_s", "tpot_p50_s"):
        assert figures[key] == statistics.median(r[key] for r in figures["by_poll_phase"])
    assert figures["completed"] == figures["requests"] == len(requests)


def test_the_shipped_fit_has_measured_in_situ_factors():
    model = InSituCostModel.from_json()
    assert model is not None  # --validate simulates with them
    assert all(0.5 < f < 3.0 for f in (model.prefill, model.decode, model.mixed))


def test_each_engine_kind_gets_its_own_factors_where_it_ran_enough_steps():
    from loadtests.sim.calibrate.in_situ import MIN_STEPS

    # the paged worker's decode steps run 1.5x the fit, the prefix worker's 1.0x; only the prefix worker prefills
    rows = {11: [("decode", False, 1.5, 1.0, 1.5)] * MIN_STEPS,
            22: [("decode", False, 1.0, 1.0, 1.0)] * (MIN_STEPS + 1) + [("prefill", False, 2.0, 1.0, 2.0)] * MIN_STEPS
            + [("mixed", False, 1.2, 1.0, 1.2)] * (MIN_STEPS - 1)}
    got = in_situ_factors(rows, {11: "paged", 22: "prefix"})
    assert got["decode"] == 1.0  # all workers' median: the prefix worker has the majority
    assert got["by_engine"]["paged"] == {"decode": 1.5}
    assert got["by_engine"]["prefix"] == {"decode": 1.0, "prefill": 2.0}  # 9 mixed steps: too few for its own
    assert "by_engine" not in in_situ_factors(rows)  # without the workers' kinds, one factor per step kind


def test_a_simulated_worker_steps_by_its_engines_factors():
    from loadtests.sim.fleet.cost_models import for_engine
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.simulator import FleetSim, StackSpec

    model = InSituCostModel(FIT, prefill=1.5, decode=1.2, mixed=1.1, by_engine={"paged": {"decode": 2.0}})
    decode = StepShape(0, 16, 16 * 600, 0, 16, 16 * 600)
    prefill = StepShape(512, 0, 512, 0, 1, 0)
    assert for_engine(model, "paged").step_seconds(decode) == pytest.approx(FIT.step_seconds(decode) * 2.0)
    assert for_engine(model, "paged").step_seconds(prefill) == pytest.approx(FIT.step_seconds(prefill) * 1.5)
    assert for_engine(model, "prefix").step_seconds(decode) == pytest.approx(FIT.step_seconds(decode) * 1.2)
    assert for_engine(FIT, "paged") is FIT  # a model without per-engine factors is used as is
    sim = FleetSim(StackSpec("t", ("paged", "prefix"), "duet"), [], model, EngineProfile.for_cost_model("cpu"))
    by_kind = {w.kind: w.runner.cost_model for w in sim.workers.values()}
    assert by_kind["paged"].step_seconds(decode) == pytest.approx(FIT.step_seconds(decode) * 2.0)
    assert by_kind["prefix"].step_seconds(decode) == pytest.approx(FIT.step_seconds(decode) * 1.2)
