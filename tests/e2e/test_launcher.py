"""The one stack launcher (duet/launcher.py) with real workers: the limits it is given are the limits the
worker runs with. `EngineLimits(paged_prefix_caching=False)` used to reach no worker (the benchmark stack
looked for the flag in duet/cli.py's source and passed nothing to turn caching off), so `duet bench
compare` printed "off" over a worker that still cached."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from duet.launcher import EngineLimits, Launcher, SimOptions, WorkerSpec, free_port, worker_argv
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from tests.support.stack import model_dir

PROMPT = [(i * 7) % 200 + 3 for i in range(96)]  # six full pages of 16: enough to be cached


def _load(address: str) -> pb.EngineLoad:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.EngineStub(ch).GetLoad(pb.GetLoadRequest(), timeout=2)


def _answers(address: str) -> bool:
    try:
        _load(address)
        return True
    except grpc.RpcError:
        return False


def _generate(address: str, request_id: str) -> None:
    with grpc.insecure_channel(address) as ch:
        req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                 sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
        for _ in pb_grpc.EngineStub(ch).Generate(req, timeout=120):
            pass


@pytest.mark.timeout(300)
def test_paged_prefix_caching_follows_the_limits(tmp_path):
    ports = {True: free_port(), False: free_port()}
    with Launcher(tmp_path) as launcher:
        for caching, port in ports.items():
            launcher.start_worker(f"paged-{caching}", WorkerSpec(
                "paged", model_dir(), port, f"paged-{caching}", device="cpu",
                limits=EngineLimits(kv_cache_tokens=4096, paged_prefix_caching=caching)))
        addresses = {c: f"127.0.0.1:{p}" for c, p in ports.items()}
        launcher.wait_until(lambda: all(_answers(a) for a in addresses.values()), 240)
        hits = {}
        for caching, address in addresses.items():
            _generate(address, "first")
            _generate(address, "again")  # the same prompt: its full pages are cached when caching is on
            time.sleep(0.2)
            hits[caching] = _load(address).prefix_cache_hits_tokens
    assert hits[False] == 0, f"prefix caching off, yet {hits[False]} tokens came from the cache"
    assert hits[True] > 0, "prefix caching on, yet nothing came from the cache"


def test_each_kind_gets_only_the_flags_it_reads():
    lim = EngineLimits(paged_prefix_caching=False)
    paged = worker_argv(WorkerSpec("paged", Path("m"), 1, limits=lim))
    prefix = worker_argv(WorkerSpec("prefix", Path("m"), 1, limits=lim))
    sim = worker_argv(WorkerSpec("sim", Path("m"), 1, "s", sim=SimOptions("paged", ms_per_token=3)))
    assert "--no-enable-prefix-caching" in paged
    assert not any("prefix-caching" in a for a in prefix)  # engine_prefix caches by its radix tree, always
    assert paged[3:5] == ["engine", "paged"] and prefix[3:5] == ["engine", "prefix"]
    assert sim[3:5] == ["engine", "sim"] and sim[sim.index("--sim-as") + 1] == "paged"
    assert "--kv-cache-tokens" not in sim and "--device" not in sim  # a sim reads no engine limits


def test_the_tensor_parallel_size_reaches_real_engines_only_when_it_splits():
    for kind in ("paged", "prefix"):
        argv = worker_argv(WorkerSpec(kind, Path("m"), 1, device="cpu", tensor_parallel_size=3))
        assert argv[argv.index("--tensor-parallel-size") + 1] == "3"
        assert "--tensor-parallel-size" not in worker_argv(WorkerSpec(kind, Path("m"), 1))
    assert "--tensor-parallel-size" not in worker_argv(WorkerSpec("sim", Path("m"), 1))


def test_a_workers_dtype_comes_from_its_spec_or_its_limits_and_defaults_to_auto():
    # `duet up` passes the dtype it printed (WorkerSpec.dtype); a benchmark passes its limits' (EngineLimits.dtype)
    def dtype_of(argv):
        return argv[argv.index("--dtype") + 1] if "--dtype" in argv else None

    assert dtype_of(worker_argv(WorkerSpec("paged", Path("m"), 1, dtype="bfloat16"))) == "bfloat16"
    assert dtype_of(worker_argv(WorkerSpec("prefix", Path("m"), 1, limits=EngineLimits(dtype="float32")))) == \
        "float32"
    both = worker_argv(WorkerSpec("prefix", Path("m"), 1, dtype="bfloat16", limits=EngineLimits(dtype="float32")))
    assert both.count("--dtype") == 1 and dtype_of(both) == "bfloat16"  # the spec's own wins
    assert dtype_of(worker_argv(WorkerSpec("paged", Path("m"), 1))) is None  # the worker's default: auto


def test_real_engines_get_their_metrics_port_and_extra_flags_and_the_flags_parse():
    import argparse

    from duet.engine_config import KINDS, add_flags, from_args

    for kind in ("paged", "prefix"):
        argv = worker_argv(WorkerSpec(kind, Path("m"), 1, metrics_port=9101, extra_args=("--kv-cache-tokens", "64")))
        assert argv[argv.index("--metrics-port") + 1] == "9101" and argv[-2:] == ["--kv-cache-tokens", "64"]
        assert "--metrics-port" not in worker_argv(WorkerSpec(kind, Path("m"), 1))
        parser = argparse.ArgumentParser()
        add_flags(parser, KINDS[kind])  # as `duet engine KIND` parses them
        config = from_args(KINDS[kind], parser.parse_args(argv[5:]))
        assert config.engine.metrics_port == 9101 and config.engine.kv_cache_tokens == 64
    with pytest.raises(AssertionError):  # a sim serves no metrics of its own
        worker_argv(WorkerSpec("sim", Path("m"), 1, metrics_port=9101))
