"""The peers' policies in the fleet simulator (loadtests/sim/fleet/peer_policies.py) make the decisions their code
makes: SMG's cache_aware (src/policies/cache_aware.rs), vllm-router's kv_aware (src/policies/kv_aware.rs) and
llm-d's default scorers (queue 2, kv-cache utilization 2, prefix 3). Expected choices are worked out by hand from
the peers' rules; and a peer stack runs in `duet bench fleet`, and `--contest` compares it with Duet's routing."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from loadtests.sim.fleet.bench import FleetSettings, contest, run
from loadtests.sim.fleet.peer_policies import LlmdDefault, SmgCacheAware, VllmKvAware, make_peer_policy

CFG = RoutingConfig()


def view(wid: str, running: int = 0, waiting: int = 0, kv: float = 0.0) -> WorkerView:
    return WorkerView(worker_id=wid, model_id="m", engine_kind="prefix", version="v1", capabilities=frozenset(),
                      healthy=True, draining=False, num_running=running, num_waiting=waiting, kv_usage=kv)


def req(hashes, tokens: int | None = None) -> RouteRequest:
    hashes = tuple(hashes)
    return RouteRequest(model="m", block_hashes=hashes, num_prompt_tokens=tokens or 16 * len(hashes), block_tokens=16)


def pick(policy, r, workers) -> str:
    return policy(r, workers, CFG, None, SeenBlocks(), WorkerBlockIndex()).worker_id


# -- SMG cache_aware ------------------------------------------------------------------------------------------
def test_smg_follows_the_longest_match_above_the_threshold_else_the_least_loaded():
    smg = SmgCacheAware()
    workers = [view("a", running=3), view("b", running=1), view("c", running=2)]
    # nothing matches: the least loaded (b), where sglang-router would take the smallest tree
    assert pick(smg, req([1, 2, 3, 4]), workers) == "b"
    # 3 of 4 blocks held by b (75% > 30%): b, although a is now the least loaded
    workers = [view("a"), view("b", running=5), view("c", running=2)]
    assert pick(smg, req([1, 2, 3, 9]), workers) == "b"
    # 1 of 4 blocks matched (25% <= 30%): the least loaded (a) gets it, and the tree learns it
    assert pick(smg, req([1, 7, 7, 7]), workers) == "a"
    assert pick(smg, req([1, 7, 7, 8]), [view("a", running=4), view("b"), view("c")]) == "a"


def test_smg_match_rate_is_over_the_whole_prompt():
    smg = SmgCacheAware()
    smg.insert("b", [1, 2])
    workers = [view("a"), view("b", running=1)]
    # 2 blocks of 16 tokens matched of a 100-token prompt: 32% > 30% -> b; of a 200-token prompt: 16% -> a
    assert pick(smg, req([1, 2, 3, 4, 5, 6], tokens=100), workers) == "b"
    # (the first prompt joined b's tree; this one leaves it after block 2)
    assert pick(smg, req([1, 2, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], tokens=200), workers) == "a"


def test_smg_imbalance_takes_the_least_loaded_and_still_records_the_prompt():
    smg = SmgCacheAware()
    smg.insert("a", [1, 2, 3, 4])
    # max - min = 70 > 64 and 80 > 1.5 x 10: imbalanced -> b despite a's full match
    assert pick(smg, req([1, 2, 3, 4]), [view("a", running=80), view("b", running=10)]) == "b"
    # 60 apart is not imbalanced: the match wins; both now hold the prompt, the most recent (b) is the tenant
    assert pick(smg, req([1, 2, 3, 4]), [view("a", running=70), view("b", running=10)]) == "b"
    # within the threshold again a holds it too, but b touched it last
    assert smg.match([1, 2, 3, 4], {"a", "b"}) == (4, "b")
    assert smg.match([1, 2, 3, 4], {"a"}) == (4, "a")


# -- vllm-router kv_aware -------------------------------------------------------------------------------------
def test_kv_aware_longest_prefix_from_events_wins_ties_go_to_the_last():
    now = [0.0]
    kv = VllmKvAware(lambda: now[0])
    kv.kv_event("a", "stored", [1, 2])
    kv.kv_event("b", "stored", [1, 2, 3])
    kv.kv_event("c", "stored", [1, 2, 3])
    workers = [view("a"), view("b", running=9), view("c", running=9)]
    # b and c hold 3 leading blocks: the last of the maxima (c), however loaded
    assert pick(kv, req([1, 2, 3, 4]), workers) == "c"
    kv.kv_event("c", "evicted", [3])
    now[0] = 10.0  # c's speculative entry for block 4 has expired
    assert pick(kv, req([1, 2, 3, 5]), workers) == "b"


def test_kv_aware_without_a_match_takes_the_first_least_loaded_and_guesses_for_two_seconds():
    now = [0.0]
    kv = VllmKvAware(lambda: now[0])
    workers = [view("a", running=2), view("b", running=1), view("c", running=1)]
    assert pick(kv, req([5, 6]), workers) == "b"  # score 0 everywhere: first of the least loaded
    # within 2 s the speculative entries send the same prefix to b, even loaded
    now[0] = 1.9
    assert pick(kv, req([5, 6, 7]), [view("a"), view("b", running=8), view("c")]) == "b"
    # 2 s after the last guess with no event from b: forgotten, the least loaded again
    now[0] = 4.0
    assert pick(kv, req([5, 6, 7]), [view("a", running=1), view("b", running=8), view("c")]) == "c"
    # as it ran here (its index never matching the request): least loaded, first of equals, always
    unmatched = make_peer_policy("vllm_kv_aware_unmatched", lambda: 0.0)
    unmatched.kv_event("c", "stored", [5, 6, 7])
    assert pick(unmatched, req([5, 6, 7]), [view("a", running=1), view("b"), view("c")]) == "b"


# -- llm-d default scorers --------------------------------------------------------------------------------------
def test_llmd_weighs_queue_kv_and_prefix_two_two_three():
    llmd = LlmdDefault()
    llmd.lru["a"] = OrderedDict.fromkeys([1, 2, 3, 4])
    # a: full match (3 x 1.0) but the longest queue (2 x 0) and KV 90% (2 x 0.1): 3.2
    # b: no match, the shortest queue (2 x 1.0), KV 10% (2 x 0.9): 3.8 -> b
    workers = [view("a", waiting=4, kv=0.9), view("b", waiting=0, kv=0.1)]
    assert llmd.scores(workers, [1, 2, 3, 4]) == pytest.approx([3.2, 3.8])
    assert pick(llmd, req([1, 2, 3, 4]), workers) == "b"
    # a's queue only 2 of 4 (2 x 0.5): 1 + 0.2 + ... with b's at 4 (0): a 3 + 2 x 1 + 0.2 = 5.2 against b 1.8
    llmd2 = LlmdDefault()
    llmd2.lru["a"] = OrderedDict.fromkeys([1, 2, 3, 4])
    workers = [view("a", waiting=2, kv=0.9), view("b", waiting=4, kv=0.1)]
    assert llmd2.scores(workers, [1, 2, 3, 4]) == pytest.approx([5.2, 1.8])
    assert pick(llmd2, req([1, 2, 3, 4]), workers) == "a"


def test_llmd_prefix_score_is_the_matched_share_of_at_most_256_blocks_and_the_choice_is_recorded():
    llmd = LlmdDefault()
    workers = [view("a"), view("b")]
    # equal everywhere (2 + 2 + 0): a seeded random pick, then the prompt is in that server's LRU
    first = pick(llmd, req(range(1, 301)), workers)
    other = "b" if first == "a" else "a"
    assert llmd.prefix_score(first, list(range(1, 257))) == 1.0
    assert llmd.prefix_score(first, list(range(257, 301))) == 0.0  # blocks past 256 were never recorded
    assert llmd.prefix_score(first, [1, 2, 999, 1000]) == 0.5
    assert pick(llmd, req([1, 2, 999, 1000]), workers) == first
    assert llmd.prefix_score(other, [1, 2]) == 0.0


# -- in the fleet simulator ---------------------------------------------------------------------------------------
def chat_workers(policy: str) -> int:
    """How many workers served the chat turns of 20 s of the mixed trace over 4 simulated workers."""
    from loadtests.sim.fleet.cost_models import cost_model
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.simulator import FleetSim, StackSpec
    from loadtests.sim.fleet.workload import MIXES, build

    profile = EngineProfile.for_cost_model("h200")
    requests = build(MIXES["mixed"], 20.0, 0.5, profile.max_model_len)
    served = FleetSim(StackSpec(policy, ("prefix",) * 4, policy), requests, cost_model("h200"), profile).run()
    return len({s.worker_id for s in served if s.req.traffic_class == "chat"})


def test_peer_stacks_run_and_the_contest_compares_each_with_duet():
    s = FleetSettings(workers=4, window_s=20.0, rate=0.5, stacks=("smg_cache_aware", "vllm_kv_aware", "llmd_default"))
    out = run(s)["stacks"]
    for name in s.stacks:
        assert out[name]["completed"] == out[name]["requests"] > 0
        assert out[name]["workers"]["end"] == {"paged": 0, "prefix": 4}
    # vllm-router's kv_aware follows the shared system-prompt block: every chat turn lands on one worker (the hot
    # spot its users report); llm-d's load scorers spread them
    assert chat_workers("vllm_kv_aware") == 1
    assert chat_workers("llmd_default") > 1
    result = contest(FleetSettings(workers=4, window_s=20.0, stacks=("llmd_default",), rate_range=(0.25, 1.0),
                                   search_steps=1))
    row = result["peers"]["llmd_default"]
    assert result["best_peer"] == "llmd_default" and result["duet_stack"] == "prefix_duet_routing"
    assert row["goodput_ratio"] == pytest.approx(row["duet"]["goodput_rps"] / row["peer"]["goodput_rps"], abs=1e-3)
    assert row["duet"]["rate"] == row["peer"]["rate"] == row["rate"]
    with pytest.raises(ValueError, match="needs at least one peer"):
        contest(FleetSettings(workers=4, stacks=("all_prefix",)))
    with pytest.raises(ValueError, match="unknown peer"):
        make_peer_policy("nginx", lambda: 0.0)


def test_contest_table_names_each_peer_its_rate_and_the_ratio():
    from loadtests.sim.fleet.cli import format_contest

    side = {"goodput_rps": 10.0, "slo_attainment": 0.9, "cached_token_share": 0.3}
    result = {"workers": 32, "cost_model": "h200", "mix": {"mooncake": 1.0}, "window_s": 300.0, "attainment": 0.9,
              "duet_stack": "prefix_duet_routing", "best_peer": "llmd_default",
              "peers": {"llmd_default": {"rate": 4.757, "peer": side, "duet": {**side, "goodput_rps": 10.5},
                                         "goodput_ratio": 1.05}}}
    table = format_contest(result)
    assert "best peer: llmd_default" in table
    assert "| llmd_default | x4.757 | 10.0 (90.0%, 30.0%) | 10.5 (90.0%, 30.0%) | 1.05 |" in table
