"""The fleet simulator runs the engine a user runs (loadtests/sim/fleet/engine.py): each kind's scheduler is built by
its worker's builder with the settings `duet engine KIND` starts with when given only the deployment's KV budget,
batch limits and page size, and engine_prefix's aging runs on the simulation's virtual clock."""

from __future__ import annotations

import argparse

import pytest

from duet.engine_config import KINDS, PrefixConfig, add_flags, from_args
from engine_core.sampler import Sampler
from engine_prefix.policy import Policy
from loadtests.sim.fleet.cost_models import RooflineCostModel
from loadtests.sim.fleet.engine import EOS, MODEL_ID, VOCAB, EngineProfile, PagePool, SimEngine, make_request

COST = RooflineCostModel()


def _started_worker_scheduler(kind: str, profile: EngineProfile):
    """The scheduler `duet engine KIND --port ... --page-size ... --kv-cache-tokens ... --max-num-seqs ...
    --max-num-batched-tokens ...` builds on the deployment's device: every other setting is the command line's
    default (engine_paged's prefill cap is the device's)."""
    parser = argparse.ArgumentParser()
    add_flags(parser, KINDS[kind])
    config = from_args(KINDS[kind], parser.parse_args([
        "--port", "50051", "--page-size", str(profile.page_size), "--kv-cache-tokens", str(profile.kv_cache_tokens),
        "--max-num-seqs", str(profile.max_num_seqs), "--max-num-batched-tokens", str(profile.max_num_batched_tokens)]))
    if kind == "paged":
        from engine_paged.worker import build_scheduler
    else:
        from engine_prefix.worker import build_scheduler
    pool = PagePool(-(-profile.kv_cache_tokens // profile.page_size), profile.page_size, profile.device)
    return build_scheduler(config, pool, Sampler(VOCAB, (EOS,), "cpu", 0), max_model_len=profile.max_model_len,
                           eos_token_ids=(EOS,), vocab_size=VOCAB, model_id=MODEL_ID)


def _settings(kind: str, scheduler) -> tuple:
    """What a scheduler was built with: its config and the parts its builder chose beside it."""
    if kind == "paged":
        bm = scheduler.bm
        return scheduler.config, bm.cache is not None, bm.watermark_pages, bm.page_size, bm.num_total_pages
    return (scheduler.config, scheduler.cache.protect_reused, scheduler.events.block_size,
            scheduler.bm.num_total_pages)


@pytest.mark.parametrize("profile", ["h200", "h200-70b", "cpu"])
@pytest.mark.parametrize("kind", ["paged", "prefix"])
def test_the_simulated_scheduler_has_the_settings_of_a_worker_started_with_its_defaults(kind, profile):
    deployment = EngineProfile.for_cost_model(profile)
    simulated = SimEngine.build("w", kind, deployment, COST, clock=lambda: 0.0).core.scheduler
    assert _settings(kind, simulated) == _settings(kind, _started_worker_scheduler(kind, deployment))


def test_the_simulated_prefix_engine_evicts_reuse_aware_and_ages():
    """What the simulator used to leave out (it built engine_prefix with LRU eviction and no aging)."""
    config = SimEngine.build("w", "prefix", EngineProfile.for_cost_model("h200"), COST,
                             clock=lambda: 0.0).core.scheduler.config
    assert config.protect_reused and config.policy is Policy.LPM
    assert config.aging_s == PrefixConfig().aging_s > 0


ONE_SLOT = EngineProfile(kv_cache_tokens=4096, max_num_seqs=1, max_num_batched_tokens=1024, max_model_len=4096)


def _admitted_first(waited_s: float) -> list[str]:
    """On a one-slot prefix engine at virtual time 100 s: a 64-token prefix is cached; a zero-match prompt that
    arrived `waited_s` ago and a fresh one that hits the prefix wait. Which the next step admits."""
    clock = {"t": 100.0}
    w = SimEngine.build("w", "prefix", ONE_SLOT, COST, clock=lambda: clock["t"])
    hot = [1 + i % 200 for i in range(64)]
    w.core.add(make_request("warm", hot + [250], 2, clock["t"]))
    while w.core.has_unfinished():
        w.step()
    w.core.add(make_request("cold", [230 + i % 20 for i in range(70)], 2, clock["t"] - waited_s))
    w.core.add(make_request("hot", hot + [251, 252], 2, clock["t"]))
    result, _ = w.step()
    return result.started


def test_aging_runs_on_the_virtual_clock():
    # the monotonic clock would make the cold prompt (arrived at virtual 90 s or 99 s) overdue either way
    assert _admitted_first(waited_s=1.0) == ["hot"]  # cache order: it has waited less than aging_s
    assert _admitted_first(waited_s=10.0) == ["cold"]  # overdue on the virtual clock: it goes first


@pytest.mark.parametrize("profile, cap", [("h200", 512), ("h200-70b", 512), ("cpu", 256)])
def test_the_simulated_paged_engine_caps_prefill_beside_decodes_as_its_device_does(profile, cap):
    config = SimEngine.build("w", "paged", EngineProfile.for_cost_model(profile), COST,
                             clock=lambda: 0.0).core.scheduler.config
    assert config.max_prefill_tokens_while_decoding == cap
