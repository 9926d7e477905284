"""`duet engine paged|prefix|sim`: each kind takes exactly the flags of its config (duet/engine_config.py), so a
flag another kind reads is argparse's usage error, and the parsed flags are the config the worker gets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from duet.cli import build_parser, main
from duet.engine_config import ENGINE_DEFAULTS, EngineConfig, PagedConfig, PrefixConfig, SimConfig, from_args

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    args = build_parser().parse_args(["engine", *argv])
    return from_args(args.config_class, args)


@pytest.mark.parametrize("argv, flag", [
    (["paged", "--speculative", "ngram"], "--speculative"),
    (["paged", "--num-draft-tokens", "4"], "--num-draft-tokens"),
    (["prefix", "--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["prefix", "--enable-prefix-caching"], "--enable-prefix-caching"),
    (["sim", "--device", "cpu"], "--device"),
    (["sim", "--kv-cache-tokens", "64"], "--kv-cache-tokens"),
    (["sim", "--max-num-batched-tokens", "64"], "--max-num-batched-tokens"),
    (["sim", "--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["sim", "--quantization", "int8"], "--quantization"),
    (["sim", "--no-compile"], "--no-compile"),
    (["paged", "--sim-ms-per-token", "3"], "--sim-ms-per-token"),
    (["prefix", "--max-prefill-tokens-while-decoding", "64"], "--max-prefill-tokens-while-decoding"),
])
def test_a_flag_the_kind_does_not_read_is_a_usage_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["engine", argv[0], "--port", "1", *argv[1:]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: duet engine {argv[0]}") and f"unrecognized arguments: {flag}" in err


@pytest.mark.parametrize("argv", [["paged", "--schedule-policy", "lpm"], ["prefix", "--schedule-policy", "priority"],
                                  ["paged", "--kv-cache-tokens", "64", "--kv-cache-memory-gb", "1"], ["prefix"],
                                  ["paged", "--tensor-parallel-size", "0"], ["prefix", "--tensor-parallel-size", "-1"],
                                  ["paged", "--quantization", "int4"],
                                  ["paged", "--max-prefill-tokens-while-decoding", "-1"],
                                  ["prefix", "--quantization", "int8", "--tensor-parallel-size", "2"]])
def test_bad_or_missing_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["engine", *argv] + (["--port", "1"] if len(argv) > 1 else []))
    assert exit_.value.code == 2 and "usage: duet engine" in capsys.readouterr().err


def test_the_defaults_of_the_flags_are_the_configs_defaults():
    assert parse("paged", "--port", "7") == PagedConfig(EngineConfig(port=7))
    assert parse("prefix", "--port", "7") == PrefixConfig(EngineConfig(port=7))
    assert parse("sim", "--port", "7") == SimConfig(EngineConfig(port=7))
    assert ENGINE_DEFAULTS.max_num_batched_tokens == 2048 and ENGINE_DEFAULTS.max_num_seqs == 64


def test_flags_become_the_kinds_config():
    paged = parse("paged", "--port", "7", "--no-enable-prefix-caching", "--schedule-policy", "priority",
                  "--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.5", "--worker-id", "w")
    assert paged == PagedConfig(EngineConfig(port=7, max_num_batched_tokens=256, kv_cache_memory_gb=0.5,
                                             worker_id="w"), enable_prefix_caching=False, schedule_policy="priority")
    prefix = parse("prefix", "--port", "7", "--speculative", "ngram", "--num-draft-tokens", "3")
    assert prefix.draft_tokens == 3 and parse("prefix", "--port", "7", "--speculative", "off").draft_tokens is None
    assert parse("prefix", "--port", "7").draft_tokens == 4  # n-gram drafting is the prefix engine's default
    sim = parse("sim", "--port", "7", "--host", "0.0.0.0", "--sim-as", "paged", "--sim-capabilities", "n,logprobs")
    assert (sim.sim_as, sim.sim_capabilities, sim.engine.worker_label) == ("paged", ("n", "logprobs"), "0.0.0.0:7")
    assert parse("sim", "--port", "7", "--sim-capabilities", "").sim_capabilities == ()


def test_the_paged_prefill_cap_is_the_devices_unless_given():
    """Unset, a CPU worker adds at most 256 prompt tokens to a decoding step and a GPU worker 512 (a GPU decode step
    hides more prefill); a given value, 0 (no cap) included, holds on every device."""
    default = parse("paged", "--port", "7")
    assert default.max_prefill_tokens_while_decoding is None
    assert (default.prefill_tokens_while_decoding("cpu"), default.prefill_tokens_while_decoding("cuda")) == (256, 512)
    for value in (0, 128):
        given = parse("paged", "--port", "7", "--max-prefill-tokens-while-decoding", str(value))
        assert given.prefill_tokens_while_decoding("cpu") == given.prefill_tokens_while_decoding("cuda") == value


def test_the_paged_time_budget_is_off_unless_given_and_must_stretch():
    assert parse("paged", "--port", "7").max_decode_step_stretch == 0.0
    assert parse("paged", "--port", "7", "--max-decode-step-stretch", "2.5").max_decode_step_stretch == 2.5
    for bad in ("1", "0.5", "-2"):
        with pytest.raises(ValueError, match="max_decode_step_stretch"):
            parse("paged", "--port", "7", "--max-decode-step-stretch", bad)


def test_the_tensor_parallel_size_reaches_paged_and_prefix_configs():
    assert parse("paged", "--port", "7", "--tensor-parallel-size", "2").engine.tensor_parallel_size == 2
    assert parse("prefix", "--port", "7", "--tensor-parallel-size", "3").engine.tensor_parallel_size == 3
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0)


def test_compile_flag_reaches_the_config_unset_by_default():
    """None (no flag): the worker decides, on where a C++ compiler is found (engine_core.cpu_compile)."""
    assert ENGINE_DEFAULTS.compile is None
    assert parse("paged", "--port", "7").engine.compile is None
    assert parse("paged", "--port", "7", "--no-compile").engine.compile is False
    assert parse("prefix", "--port", "7", "--compile").engine.compile is True


def test_quantization_reaches_the_config_and_the_launched_workers_command_line(tmp_path):
    from duet.launcher import EngineLimits, WorkerSpec, worker_argv

    assert parse("prefix", "--port", "7", "--quantization", "int8").engine.quantization == "int8"
    assert ENGINE_DEFAULTS.quantization == "none"
    argv = worker_argv(WorkerSpec("paged", tmp_path, 7, limits=EngineLimits(quantization="int8")))
    assert argv[argv.index("--quantization") + 1] == "int8"
    assert "--quantization" not in worker_argv(WorkerSpec("paged", tmp_path, 7, limits=EngineLimits()))


def test_a_config_built_in_code_refuses_an_unknown_choice():
    with pytest.raises(ValueError, match="schedule_policy"):
        PagedConfig(schedule_policy="lpm")
    with pytest.raises(ValueError, match="sim_as"):
        SimConfig(sim_as="vllm")


def test_duet_engine_sim_serves_without_torch_or_loadtests():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "duet.cli", "engine", "sim", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the sim did not listen: {proc.communicate(timeout=10)[1][-2000:]}")
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "duet.sim_worker" in imported
    assert not {m for m in imported if m.split(".")[0] in ("loadtests", "torch")}


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_bench_help_lists_the_bench_commands(flag, capsys):
    # `duet bench -h` is the load-test CLI's help, not the top-level parser's "unrecognized arguments"
    with pytest.raises(SystemExit) as done:
        main(["bench", flag])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: duet bench" in out and "fleet" in out and "classes" in out
