"""Which cpu step-cost fit the simulator reads, what it records about the machine, dtype and threads it timed, and
what advise and --validate do with that (loadtests/sim/fleet/cpu_fit.py). No timing is asserted: only which file,
which dtype, which words a user reads."""

from __future__ import annotations

import json
import shutil

import pytest

from duet.model_make import default_model_dir
from loadtests.cli import main
from loadtests.sim.fleet import cpu_fit

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
"""
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni
"""
ZEN3 = """vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse2 avx2 fma
"""


def _fit(tmp_path, name="fit.json", **record) -> object:
    """A fit file: the repository's coefficients with `record` (cpu, dtype, threads) in place of its own."""
    fit = json.loads(cpu_fit.REPO_FIT.read_text())
    for key in ("cpu", "dtype", "threads", "cpu_recorded"):
        fit.pop(key, None)
    path = tmp_path / name
    path.write_text(json.dumps({**fit, **record}))
    return path


def test_this_cpu_reads_the_first_processor_and_the_flags_that_change_a_steps_cost():
    cpu = cpu_fit.this_cpu(XEON)
    assert (cpu["vendor"], cpu["family"], cpu["model"]) == ("GenuineIntel", "6", "207")
    assert cpu["flags"] == ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma"]
    assert cpu_fit.machine_key(cpu) == "GenuineIntel-f6-m207"
    assert cpu_fit.this_cpu("")["flags"] == []  # no /proc/cpuinfo: nothing invented


def test_a_fit_of_this_machine_at_the_dtype_duet_up_picks_matches(tmp_path):
    path = _fit(tmp_path, **cpu_fit.fit_record("bfloat16", 1, XEON))
    report = cpu_fit.fit_report(path, environ={}, cpuinfo=XEON)  # auto on an AMX Xeon: bf16
    assert report["matches"] and report["differences"] == []
    assert (report["fit_dtype"], report["fit_threads"], report["auto_dtype_here"]) == ("bfloat16", 1, "bfloat16")
    assert cpu_fit.format_warning(report) == []


def test_a_zen4_fp32_fit_on_an_amx_xeon_says_each_difference(tmp_path):
    # the repository's fit is the Zen 4's, fp32 (the 2026-12-06 miss): advise on the Xeon must say so
    report = cpu_fit.fit_report(cpu_fit.REPO_FIT, environ={}, cpuinfo=XEON)
    assert not report["matches"]
    machine, features, dtype = report["differences"]
    assert "AuthenticAMD family 25 model 17" in machine and "GenuineIntel family 6 model 207" in machine
    assert features == "CPU features differ: this one has amx_bf16, amx_int8, amx_tile"
    assert dtype.startswith("the fit timed float32; `duet up` here computes bfloat16 (--dtype auto)")
    text = "\n".join(cpu_fit.format_fit(report))
    assert text.startswith("**Warning: the cpu cost fit describes another machine or dtype**")
    assert "- CPU features differ: this one has amx_bf16" in text


def test_same_cpu_kind_but_features_or_dtype_differ(tmp_path):
    # a Zen 3 fit on a Zen 4 (same vendor and family, another model): both the model and the features differ
    report = cpu_fit.fit_report(_fit(tmp_path, **cpu_fit.fit_record("float32", 1, ZEN3)), environ={}, cpuinfo=ZEN4)
    assert len(report["differences"]) == 3
    assert report["differences"][1] == ("CPU features differ: this one has avx512_bf16, avx512_vnni, avx512f")
    # DUET_DTYPE pins what auto picks (as the workers read it): a float32 fit then matches on the Zen 4
    same = _fit(tmp_path, "same.json", **cpu_fit.fit_record("float32", 1, ZEN4))
    assert cpu_fit.fit_report(same, environ={"DUET_DTYPE": "float32"}, cpuinfo=ZEN4)["matches"]
    assert cpu_fit.fit_report(same, environ={}, cpuinfo=ZEN4)["differences"] == [
        ("the fit timed float32; `duet up` here computes bfloat16 (--dtype auto): the prediction is for workers "
        "started with --dtype float32")]


def test_a_fit_that_records_nothing_is_not_taken_for_this_machine(tmp_path):
    report = cpu_fit.fit_report(_fit(tmp_path), environ={}, cpuinfo=XEON)
    assert not report["matches"]
    assert report["differences"] == [
        ("the fit does not record the CPU it was measured on (fitted before fits recorded it): run `duet bench "
        "fleet-calibrate` here"), "the fit does not record the dtype it timed"]


def test_which_fit_is_read_the_file_given_then_this_machines_then_the_repositorys(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    xeon = cpu_fit.this_cpu(XEON)
    assert cpu_fit.fit_path(environ={}, cpu=xeon) == cpu_fit.REPO_FIT
    own = cpu_fit.machine_fit_path(xeon)
    assert own == tmp_path / "cache" / "cpu-cost" / "GenuineIntel-f6-m207.json"
    own.parent.mkdir(parents=True)
    shutil.copy(cpu_fit.REPO_FIT, own)
    assert cpu_fit.fit_path(environ={}, cpu=xeon) == own
    assert cpu_fit.fit_source(own, environ={}, cpu=xeon) == "this machine's own (duet bench fleet-calibrate)"
    assert cpu_fit.fit_path(environ={}, cpu=cpu_fit.this_cpu(ZEN4)) == cpu_fit.REPO_FIT  # another CPU: not its fit
    given = _fit(tmp_path)
    assert cpu_fit.fit_path(environ={cpu_fit.COST_FILE_ENV: str(given)}, cpu=xeon) == given
    with pytest.raises(FileNotFoundError, match="no such cost fit"):
        cpu_fit.fit_path(environ={cpu_fit.COST_FILE_ENV: str(tmp_path / "none.json")}, cpu=xeon)


def test_cost_file_must_hold_a_step_fit(tmp_path):
    env = {}
    with pytest.raises(ValueError, match="no such file"):
        cpu_fit.use_cost_file(str(tmp_path / "none.json"), env)
    sections_only = tmp_path / "sections.json"
    sections_only.write_text(json.dumps({"neighbour_slowdown": 0.01}))
    with pytest.raises(ValueError, match="holds no step fit"):
        cpu_fit.use_cost_file(str(sections_only), env)
    assert env == {}
    assert cpu_fit.use_cost_file(str(_fit(tmp_path)), env) == (tmp_path / "fit.json").resolve()
    assert env[cpu_fit.COST_FILE_ENV] == str((tmp_path / "fit.json").resolve())


def test_the_validated_stack_runs_at_the_fits_dtype_and_threads(tmp_path, monkeypatch):
    # the stack computes what the fit timed, whatever the checkpoint's own dtype (fp32 here) or --dtype auto says
    from loadtests.sim.fleet.validate import stack_limits

    monkeypatch.setenv(cpu_fit.COST_FILE_ENV, str(_fit(tmp_path, **cpu_fit.fit_record("bfloat16", 2, XEON))))
    _, limits = stack_limits(str(default_model_dir()))
    assert (limits.dtype, limits.torch_threads) == ("bfloat16", 2)
    # a fit that does not record its dtype timed the checkpoint's own (steps.py before it recorded one)
    monkeypatch.setenv(cpu_fit.COST_FILE_ENV, str(_fit(tmp_path, "old.json")))
    _, limits = stack_limits(str(default_model_dir()))
    assert (limits.dtype, limits.torch_threads) == ("float32", 1)


def test_calibration_records_the_cpu_dtype_and_threads_and_drops_another_machines_sections(tmp_path):
    from loadtests.sim.calibrate.steps import measure

    out = tmp_path / "fit.json"
    # sections measured on another machine: they do not describe this fit's steps
    out.write_text(json.dumps({"cpu": cpu_fit.this_cpu(ZEN3), "dtype": "float32", "neighbour_slowdown": 0.5,
                               "gateway": {"request_s": 1.0, "token_s": 1.0}}))
    shapes = [[(16, 0)], [(32, 16)], [(1, 16)] * 2, [(1, 40)] * 4]
    result = measure(str(default_model_dir()), 1, 1, out, dtype="auto", shapes=shapes)  # the tests pin auto to fp32
    written = json.loads(out.read_text())
    assert (written["dtype"], written["dtype_requested"], written["threads"]) == ("float32", "auto", 1)
    assert written["cpu"] == cpu_fit.this_cpu() and len(written["points"]) == len(shapes)
    assert "neighbour_slowdown" not in written and "gateway" not in written
    assert result["out"] == str(out)
    # this machine's sections at the same dtype are kept when the step fit is remeasured
    written["neighbour_slowdown"] = 0.02
    out.write_text(json.dumps(written))
    measure(str(default_model_dir()), 1, 1, out, dtype="float32", shapes=shapes, clock="thread")
    again = json.loads(out.read_text())
    assert again["neighbour_slowdown"] == 0.02
    assert written["clock"] == "wall" and again["clock"] == "thread" and "thread CPU time" in again["how"]
    assert cpu_fit.fit_report(out)["fit_cpu"] == cpu_fit.this_cpu()


def _capture(path) -> None:
    lines = [json.dumps({"timestamp": i * 250.0, "input_length": 600, "output_length": 8,
                         "hash_ids": [(1 << 41) + 7, (1 << 40) + i], "session": "", "class": "", "engine": "prefix",
                         "model": "tiny"}) for i in range(12)]
    path.write_text("\n".join(lines) + "\n")


def test_advise_on_the_cpu_model_says_which_fit_and_warns_when_it_is_another_machines(tmp_path, capsys, monkeypatch):
    # --cost-file sets the variable for the whole process (the CLI's lifetime): restored after this test
    monkeypatch.setenv(cpu_fit.COST_FILE_ENV, str(cpu_fit.REPO_FIT))
    capture = tmp_path / "capture.jsonl"
    _capture(capture)
    foreign = _fit(tmp_path, **cpu_fit.fit_record("float32", 1, ZEN3 if "GenuineIntel" in
                                                   cpu_fit.this_cpu()["vendor"] else XEON))
    assert main(["advise", "--trace", str(capture), "--fleet", "--cost-model", "cpu", "--workers", "2",
                 "--cost-file", str(foreign), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    fit = result["cost_fit"]
    assert fit["file"] == str(foreign.resolve()) and fit["source"].startswith("given")
    assert not fit["matches"] and fit["differences"][0].startswith("the fit was measured on ")
    assert "warning: the fit was measured on " in captured.err
    assert main(["advise", "--trace", str(capture), "--fleet", "--cost-model", "cpu", "--workers", "2",
                 "--cost-file", str(foreign)]) == 0
    assert "**Warning: the cpu cost fit describes another machine or dtype**" in capsys.readouterr().out


def test_fleet_on_the_cpu_model_reports_the_fit_and_a_matching_one_warns_of_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(cpu_fit.COST_FILE_ENV, str(cpu_fit.REPO_FIT))
    monkeypatch.delenv("DUET_DTYPE")  # what `duet up` picks here, as a user's shell has it
    auto = cpu_fit.resolve_dtype("auto", "cpu")
    own = _fit(tmp_path, **cpu_fit.fit_record(auto, 1))  # this machine, at the dtype duet up computes in here
    capture = tmp_path / "capture.jsonl"
    _capture(capture)
    argv = ["fleet", "--cost-model", "cpu", "--workers", "2", "--trace", str(capture), "--stacks", "all_prefix"]
    assert main([*argv, "--cost-file", str(own), "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)["cost_fit"]
    assert fit["matches"] and fit["differences"] == [] and fit["fit_dtype"] == auto
    foreign = _fit(tmp_path, "foreign.json", **cpu_fit.fit_record(auto, 1, ZEN3 if "GenuineIntel" in
                                                                   cpu_fit.this_cpu()["vendor"] else XEON))
    assert main([*argv, "--cost-file", str(foreign)]) == 0
    assert capsys.readouterr().out.startswith("**Warning: the cpu cost fit describes another machine or dtype**")


@pytest.mark.parametrize("argv, message", [
    (["advise", "--fleet", "--cost-model", "h200", "--cost-file", "x.json"], "--cost-file is the cpu cost model's fit"),
    (["advise", "--simulate", "--cost-file", "x.json"], "--cost-file does not apply to --simulate"),
    (["fleet", "--cost-model", "h200", "--cost-file", "x.json"], "--cost-file is the cpu cost model's fit"),
    (["fleet-calibrate", "--gateway", "--out", "/nonexistent/fit.json"], "/nonexistent/fit.json holds no step fit"),
    (["fleet-calibrate", "--clock", "thread", "--threads", "2", "--out", "/nonexistent/fit.json"],
     "--clock 'thread': wall, or thread with --threads 1"),
])
def test_cost_file_flags_are_checked(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
