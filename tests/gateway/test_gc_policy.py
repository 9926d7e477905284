"""`duet gateway`'s cyclic-GC policy (gateway/gc_policy.py), as an operator sees it on /metrics: a gateway started
with the default config runs with startup's objects frozen and a generation-0 threshold of 10,000, one with
`gc: {freeze: false, gen0_threshold: null}` with Python's own GC; under the same streamed requests the first
makes far fewer collections. Real processes: a sim worker and two gateways in front of it."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from duet.launcher import Launcher, SimOptions, WorkerSpec, free_port, gateway_config, healthy_workers
from duet.model_make import default_model_dir
from gateway.config import ConfigError, from_dict
from loadtests.experiments.gateway_bench import streams_burst

STREAMS = 200  # streamed chats through each gateway: ~100 generation-0 collections with Python's GC


def gc_metrics(url: str) -> dict[str, float]:
    """{"collections_0": n, ..., "threshold_0": n, ..., "frozen": n} from the gateway's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "duet_gateway_gc_collections_total":
                out[f"collections_{s.labels['generation']}"] = s.value
            elif s.name == "duet_gateway_gc_threshold":
                out[f"threshold_{s.labels['generation']}"] = s.value
            elif s.name == "duet_gateway_gc_frozen_objects":
                out["frozen"] = s.value
    return out


def test_default_gateway_freezes_startup_and_collects_less_often(tmp_path):
    model = default_model_dir()
    worker, policy_port, python_port = free_port(), free_port(), free_port()
    urls = {name: f"http://127.0.0.1:{p}" for name, p in (("policy", policy_port), ("python", python_port))}
    with Launcher(tmp_path / "logs") as stack:
        stack.start_worker("sim", WorkerSpec("sim", model, worker, "sim", sim=SimOptions("prefix", ms_per_token=5)))
        stack.start_gateway("policy", gateway_config(model, [f"127.0.0.1:{worker}"], port=policy_port))
        stack.start_gateway("python", gateway_config(model, [f"127.0.0.1:{worker}"], port=python_port,
                                                     gc={"freeze": False, "gen0_threshold": None}))
        stack.wait_until(lambda: all(healthy_workers(u) >= 1 for u in urls.values()), timeout_s=60)
        before = {name: gc_metrics(u) for name, u in urls.items()}
        for name, port in (("policy", policy_port), ("python", python_port)):
            errors, _ = asyncio.run(streams_burst(port, model.name, STREAMS, 8))
            assert errors == 0, name
        after = {name: gc_metrics(u) for name, u in urls.items()}

    policy, python = before["policy"], before["python"]
    # the policy in force: startup's objects frozen (tens of thousands: tokenizer, routes, metrics, modules)
    assert policy["threshold_0"] == 10_000 and policy["frozen"] > 10_000, policy
    assert (policy["threshold_1"], policy["threshold_2"]) == (10, 10), policy  # Python's, kept
    assert python["threshold_0"] == 700 and python["frozen"] == 0, python
    # the same requests: ~14x fewer generation-0 collections with the policy (docs/benchmarks.md); half is the
    # bound, wide enough for what a loaded machine's timing moves (polls, retries)
    made = {name: after[name]["collections_0"] - before[name]["collections_0"] for name in urls}
    assert made["python"] >= 20, made
    assert made["policy"] < made["python"] / 2, made


@pytest.mark.parametrize("raw", [{"gen0_threshold": 0}, {"gen0_threshold": "lots"}, {"freez": True}])
def test_bad_gc_section_is_refused_with_the_key_named(raw):
    with pytest.raises(ConfigError) as e:
        from_dict({"gc": raw})
    assert "gc" in str(e.value)


def test_gc_section_defaults_and_python_own():
    assert (from_dict({}).gc.freeze, from_dict({}).gc.gen0_threshold) == (True, 10_000)
    off = from_dict({"gc": {"freeze": False, "gen0_threshold": None}}).gc
    assert (off.freeze, off.gen0_threshold) == (False, None)
