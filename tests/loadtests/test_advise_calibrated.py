"""Step costs calibrated from measured backend rates (loadtests/advise/calibrated.py): rates in, the model's step
costs out (checked by hand), the gateway's worker rows read per kind, clear errors where a rate is missing, and the
vLLM kind simulated with vLLM's scheduler settings."""

from __future__ import annotations

import argparse

import pytest

from loadtests.advise import calibrated
from loadtests.advise.calibrated import MeasuredRates, NoMeasuredRate
from loadtests.sim.fleet.cost_models import StepShape, for_engine


def test_rates_in_step_costs_out():
    model = calibrated.calibrate(MeasuredRates("vllm", "paged", prefill_tokens_per_s=2000.0,
                                               decode_tokens_per_s=200.0, step_s=0.005))
    # one prefill token 1/2000 s, one decode token 1/200 s, 5 ms a step
    assert (model.intercept_s, model.per_prefill_token_s, model.per_decode_token_s) == (0.005, 0.0005, 0.005)
    assert model.per_attended_pair_s == 0.0 and model.per_row_s == 0.0
    # a mixed step of a 512-token prompt chunk and 4 decodes: 5 ms + 512/2000 s + 4/200 s = 0.281 s
    step = StepShape(prefill_tokens=512, decode_tokens=4, context_tokens=9000, attended_pairs=10**6, rows=5)
    assert model.step_seconds(step) == pytest.approx(0.281)
    # no intercept given: a decode step of 8 costs 8/200 s, what the measured rate says
    plain = calibrated.calibrate(MeasuredRates("vllm", "paged", 2000.0, 200.0))
    assert plain.step_seconds(StepShape(decode_tokens=8, rows=8)) == pytest.approx(0.04)


def test_the_measured_decode_step_splits_into_a_fixed_cost_and_a_prefill_tokens_cost():
    # decode 200 tok/s measured at 4 tokens a step: a step of 4 took 4/200 = 20 ms; a token's own cost is a prefill
    # token's, 1/2000 s, so the step's fixed cost is 20 ms - 4 x 0.5 ms = 18 ms
    model = calibrated.calibrate(MeasuredRates("vllm", "paged", 2000.0, 200.0, decode_batch=4.0))
    assert model.intercept_s == pytest.approx(0.018)
    assert (model.per_prefill_token_s, model.per_decode_token_s) == (0.0005, 0.0005)
    assert model.step_seconds(StepShape(decode_tokens=4, rows=4)) == pytest.approx(0.020)  # the measured step
    assert model.step_seconds(StepShape(decode_tokens=16, rows=16)) == pytest.approx(0.026)  # not 16/200 = 80 ms
    line = MeasuredRates("vllm", "paged", 2000.0, 200.0, decode_batch=4.0).source()
    assert "step seconds = 18.00 ms + prefill tokens / 2,000 + decode tokens / 2,000 (the measured decode step, " \
           "4.00 tokens in 20.00 ms, split" in line
    # a prefill rate slower a token than the decode rate (prompts batched read low): no split, no intercept
    slow = calibrated.calibrate(MeasuredRates("vllm", "paged", 100.0, 200.0, decode_batch=4.0))
    assert (slow.intercept_s, slow.per_decode_token_s) == (0.0, 1 / 200)
    # the batch given on the command line does the same
    given = calibrated.parse_backend_rates(["vllm:prefill=2000,decode=200,batch=4"])["paged"]
    assert calibrated.calibrate(given).intercept_s == pytest.approx(0.018)


def _row(worker, engine="vllm", kind="paged", prefill=0.0, decode=0.0, model="m", source="engine", **extra):
    return {"worker_id": worker, "model_id": model, "engine_kind": kind, "engine": engine,
            "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
            "prefill_rate_source": source if prefill else "", "page_size": 16, "max_model_len": 4096, **extra}


def test_worker_rows_give_each_external_kinds_mean_rates():
    rows = [_row("http://a:1", prefill=2000.0, decode=100.0, decode_tokens_per_step=2.0),
            _row("http://b:1", prefill=3000.0, decode=300.0, decode_tokens_per_step=4.0),
            _row("w-duet", engine="duet", prefill=99.0, decode=9.0),  # Duet's own worker: not a backend to calibrate
            _row("http://c:1", engine="sglang", kind="prefix", prefill=500.0, source="gateway"),
            _row("http://d:1", model="other", prefill=1.0, decode=1.0)]
    got = calibrated.rates_from_rows(rows, "m", None, "2026-12-06 19:00:00 UTC")
    paged, prefix = got["paged"], got["prefix"]
    assert (paged.engine, paged.prefill_tokens_per_s, paged.decode_tokens_per_s) == ("vllm", 2500.0, 200.0)
    assert paged.workers == ("http://a:1", "http://b:1") and paged.measured_at == "2026-12-06 19:00:00 UTC"
    assert paged.decode_batch == 3.0
    assert (prefix.engine, prefix.prefill_source, prefix.decode_tokens_per_s) == ("sglang", "gateway", 0.0)
    assert "calibrated from vllm backend http://a:1, http://b:1's measured rates at 2026-12-06 19:00:00 UTC: " \
           "prefill 2,500 tok/s, decode 200 tok/s at 3.00 tokens a step" in paged.source()
    assert set(calibrated.rates_from_rows(rows, "m", {"paged"})) == {"paged"}  # the kinds the capture was served by


def test_a_kind_duets_own_workers_serve_beside_a_backend_takes_their_measured_rates():
    rows = [_row("http://a:1", prefill=2000.0, decode=100.0),
            _row("w1", engine="duet", kind="prefix", prefill=900.0, decode=60.0),
            _row("w2", engine="duet", kind="prefix")]  # no rate yet: left out of the mean
    got = calibrated.rates_from_rows(rows, "m", {"paged", "prefix"})
    assert (got["prefix"].engine, got["prefix"].workers, got["prefix"].prefill_tokens_per_s) == ("duet", ("w1",), 900.0)
    assert got["prefix"].source().startswith("calibrated from Duet worker w1's measured rates: prefill 900 tok/s")
    cal = calibrated.build_calibration(got)
    assert for_engine(cal.cost_model, "prefix").per_decode_token_s == pytest.approx(1 / 60)
    assert not any("priced at" in n for n in cal.notes)  # both kinds measured: nothing assumed of either
    # Duet's own engines alone: nothing to calibrate (advise keeps its named cost model)
    assert calibrated.rates_from_rows(rows[1:], "m", None) == {}


def test_no_measured_rate_says_send_traffic_first():
    (fresh,) = calibrated.rates_from_rows([_row("http://a:1")], "m", None).values()
    with pytest.raises(NoMeasuredRate, match=r"backend vllm \(http://a:1\) has no measured prefill or decode rate "
                                              r"yet: send traffic first"):
        calibrated.calibrate(fresh)
    sglang = MeasuredRates("sglang", "prefix", 500.0, 0.0, workers=("http://c:1",))
    with pytest.raises(NoMeasuredRate, match="--backend-rates sglang:decode="):
        calibrated.calibrate(sglang)
    # the given decode rate fills the one SGLang's counters cannot give
    given = calibrated.parse_backend_rates(["sglang:decode=400"])
    merged = calibrated.merge_given({"prefix": sglang}, given)["prefix"]
    assert (merged.prefill_tokens_per_s, merged.decode_tokens_per_s, merged.decode_source) == (500.0, 400.0, "given")
    assert calibrated.calibrate(merged).per_decode_token_s == pytest.approx(1 / 400)


@pytest.mark.parametrize("flag, message", [
    ("prefill=100,decode=10", "expected ENGINE:prefill=N"),
    ("trt:prefill=100,decode=10", "ENGINE one of vllm, sglang"),
    ("vllm:prefill=fast", "prefill must be a number"),
    ("vllm:prefill=-5,decode=10", "prefill must be > 0"),
    ("vllm:speed=5", "'speed=5' is not one of prefill=N"),
])
def test_bad_backend_rates_are_named(flag, message):
    with pytest.raises(ValueError, match=message):
        calibrated.parse_backend_rates([flag])


def test_the_vllm_kind_runs_the_paged_scheduler_with_vllms_settings():
    rates = calibrated.parse_backend_rates(["vllm:prefill=8000,decode=1000,step_ms=4,kv_tokens=50000"])
    rates["paged"] = calibrated.replace(rates["paged"], page_size=32, max_model_len=8192)
    cal = calibrated.build_calibration(rates, "gpu")
    p = cal.profile
    assert (p.paged_prefill_cap, p.page_size, p.max_model_len, p.kv_cache_tokens) == (0, 32, 8192, 50000)
    paged = for_engine(cal.cost_model, "paged")
    assert (paged.intercept_s, paged.per_prefill_token_s, paged.per_decode_token_s) == (0.004, 1 / 8000, 1 / 1000)
    # the other kind: Duet's engine_prefix at the same measured costs, and the output says so
    assert for_engine(cal.cost_model, "prefix") is paged
    assert any("prefix workers (Duet's engine_prefix) are priced at vllm's measured step costs" in n for n in cal.notes)
    assert cal.slos.bound("chat") == calibrated.ClassSlo(calibrated.bounds_at(calibrated.CLASSES, "gpu")).bound("chat")

    from loadtests.sim.fleet.engine import build_scheduler

    sched = build_scheduler("paged", p)
    assert sched.config.max_prefill_tokens_while_decoding == 0  # vLLM's chunked prefill: no cap beyond the budget
    assert sched.bm.page_size == 32


def test_option_labels_name_the_engines():
    from loadtests.advise.fleet import option_labels

    cal = calibrated.build_calibration(calibrated.parse_backend_rates(["vllm:prefill=8000,decode=1000"]))
    options = {"all_paged": {"workers": {"paged": 4, "prefix": 0}},
               "all_prefix": {"workers": {"paged": 0, "prefix": 4}},
               "paged_duet_routing": {"workers": {"paged": 4, "prefix": 0}},
               "duet_1:3": {"workers": {"paged": 1, "prefix": 3}}}
    assert option_labels(options, cal) == {"all_paged": "all vllm", "all_prefix": "all duet prefix",
                                           "paged_duet_routing": "all vllm, Duet's routing",
                                           "duet_1:3": "1 vllm + 3 duet prefix"}


def _args(*flags):
    from loadtests.cli import build_parser

    return build_parser().parse_args(["advise", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--simulate", "--backend-rates", "vllm:prefill=1,decode=1"], "without --simulate"),
    (["--backend-rates", "vllm:prefill=1,decode=1", "--cost-model", "h200"], "two cost models: give one"),
    (["--from-gateway", "http://g:1", "--cost-from-gateway", "http://g:1"], "leave out --cost-from-gateway"),
])
def test_flags_that_contradict_calibration_are_refused(flags, message):
    from loadtests.advise.cli import mode_of

    with pytest.raises(ValueError, match=message):
        mode_of(_args(*flags))


def test_backend_rates_imply_the_fleet_simulator():
    from loadtests.advise.cli import FLEET, mode_of

    args = _args("--backend-rates", "vllm:prefill=1,decode=1", "--cost-from-gateway", "http://g:1",
                 "--admin-key", "k")
    assert mode_of(args) == FLEET and isinstance(args, argparse.Namespace)


def test_backend_rates_on_a_trace_file_advise_sglang_as_the_radix_scheduler(tmp_path, capsys):
    import json

    from duet.cli import main as duet_main

    trace = tmp_path / "trace.jsonl"
    # six one-shot requests a second apart, two sharing a two-block prefix
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 16,
                                         "hash_ids": [1, 2] if i < 2 else [10 + i, 20 + i], "session": ""}) + "\n"
                             for i in range(6)))
    assert duet_main(["bench", "advise", "--trace", str(trace), "--backend-rates",
                      "sglang:prefill=4000,decode=500", "--workers", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cal = result["calibration"]
    assert list(cal["kinds"]) == ["prefix"] and cal["kinds"]["prefix"]["engine"] == "sglang"
    assert cal["kinds"]["prefix"]["source"].startswith("calibrated from the rates given for sglang (--backend-rates): "
                                                       "prefill 4,000 tok/s, decode 500 tok/s")
    assert cal["step_costs"]["prefix"] == {"intercept_s": 0.0, "per_prefill_token_s": 1 / 4000,
                                           "per_decode_token_s": 1 / 500}
    assert cal["profile"]["paged_prefill_cap"] is None  # no vLLM here: engine_paged keeps its own defaults
    assert any("paged workers (Duet's engine_paged) are priced at sglang's" in n for n in cal["notes"])
    assert any("SGLang's radix cache is simulated at 16-token pages" in n for n in cal["notes"])
    assert (result["labels"]["all_prefix"], result["labels"]["all_paged"]) == ("all sglang", "all duet paged")
    assert result["worker_hour_usd"] == 3.50 and "canary" not in result  # a plain trace: no serving kinds known
    assert any(n.startswith("cost per million tokens at $3.5 a worker-hour, the gpu profile's default") for n in cal["notes"])


def test_fleet_settings_name_the_slo_profile_they_judge_by():
    from loadtests.sim.fleet.bench import CALIBRATED, FleetSettings

    cal = calibrated.build_calibration(calibrated.parse_backend_rates(["vllm:prefill=8000,decode=1000"]), "cpu")
    s = FleetSettings(cost_model=CALIBRATED, slos=cal.slos, calibration=cal).validate()
    assert (s.slo_profile(), FleetSettings(cost_model="h200").slo_profile()) == ("cpu", "gpu")
    assert s.engine_profile() is cal.profile and s.step_cost_model() is cal.cost_model
    with pytest.raises(ValueError, match="a calibration goes with cost_model 'calibrated' and its own SLO table"):
        FleetSettings(cost_model="h200", calibration=cal).validate()
