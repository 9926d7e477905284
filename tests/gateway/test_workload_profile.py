"""The live workload profile and the capture's records, in process: repetition within and across sessions,
windows and bounds, salting. The live stack (tests/e2e/test_workload_capture.py) checks them end to end."""

import gc
import json
import random

import pytest

from duet.contract import TRACE_BLOCK_TOKENS
from duet.hashing import block_hashes
from gateway.control.capture import CaptureConfig, TraceCapture, salted_ids
from gateway.control.profile import ALL, BlockOwners, WorkloadProfile
from gateway.control.state.memory import MemoryStore
from loadtests.traces.mooncake import load_trace


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


def _record(profile: WorkloadProfile, prompt: list[int], session: str | None = None, model: str = "m",
            engine: str = "prefix", cached: int = 0, turns: int = 1, cls: str = "oneshot") -> None:
    profile.record(model=model, session=session, turns=turns, hashes=block_hashes(prompt, 16, model),
                   prompt_tokens=len(prompt), output_tokens=20, traffic_class=cls, engine=engine,
                   cached_tokens=cached, duration_s=0.5)


def test_shared_system_prompt_counts_as_cross_session_repetition():
    rng = random.Random(1)
    system = _ids(rng, 1024)  # 64 blocks
    profile = WorkloadProfile(clock=Clock())
    for _ in range(10):
        _record(profile, system + _ids(rng, 256))  # 16 unique blocks each
    p = profile.snapshot(60)["models"][ALL]["prefix_repetition"]
    # the first request is new; the 9 others repeat the 64 system blocks of their 80
    assert p["blocks"] == 800
    assert p["cross_session"] == pytest.approx(9 * 64 / 800, abs=1e-4)
    assert p["within_session"] == 0.0


def test_a_conversation_repeats_its_own_history_within_its_session():
    rng = random.Random(2)
    profile = WorkloadProfile(clock=Clock())
    history = _ids(rng, 320)  # 20 blocks
    _record(profile, history, session="a")
    history += _ids(rng, 160)  # the second turn resends the first and adds 10 blocks
    _record(profile, history, session="a", turns=2)
    _record(profile, history, session="b")  # another session sending the same text: a cross-session repeat
    p = profile.snapshot(60)["models"][ALL]
    assert p["prefix_repetition"]["within_session"] == pytest.approx(20 / 80, abs=1e-4)
    assert p["prefix_repetition"]["cross_session"] == pytest.approx(30 / 80, abs=1e-4)
    assert p["session_turns"]["sessions"] == 2 and p["session_turns"]["p99"] == 2


def test_lengths_rates_classes_and_engine_hit_rates_per_model_and_overall():
    clock = Clock()
    profile = WorkloadProfile(clock=clock)
    rng = random.Random(3)
    for i in range(30):
        _record(profile, _ids(rng, 100 if i % 3 else 3000), model="a" if i % 2 else "b",
                engine="prefix" if i % 2 else "paged", cached=50 if i % 2 else 0,
                cls="document" if i % 3 == 0 else "oneshot")
        clock.now += 1
    snap = profile.snapshot(60)["models"]
    assert set(snap) == {ALL, "a", "b"}
    overall = snap[ALL]
    assert overall["requests"] == 30 and overall["arrival_rps"] == 0.5
    assert overall["classes"] == {"document": pytest.approx(1 / 3, abs=1e-3), "oneshot": pytest.approx(2 / 3, abs=1e-3)}
    hist = overall["prompt_tokens"]["histogram"]
    assert sum(hist["counts"]) == 30 and hist["counts"][hist["le"].index(128)] == 20
    assert hist["counts"][hist["le"].index(4096)] == 10
    # model a: 15 requests on prefix with 50 cached tokens each; 10 prompts of 100 tokens and 5 of 3,000
    assert snap["a"]["engines"]["prefix"]["hit_rate"] == pytest.approx(15 * 50 / (10 * 100 + 5 * 3000), abs=1e-4)
    assert snap["b"]["engines"]["paged"]["hit_rate"] == 0.0
    # each request took 0.5 s, one a second: 15 busy seconds over the minute
    assert overall["concurrency_mean"] == pytest.approx(15 / 60, abs=1e-3)


def test_old_requests_leave_the_window_and_memory_is_bounded():
    clock = Clock()
    profile = WorkloadProfile(max_window_s=60, max_requests=50, max_blocks=100, clock=clock)
    rng = random.Random(4)
    for _ in range(200):
        _record(profile, _ids(rng, 160))
    assert profile.snapshot(60)["models"][ALL]["requests"] == 50
    assert profile.snapshot(60)["tracked_blocks"] <= 2 * 100 + 10
    clock.now += 61
    assert profile.snapshot(60)["models"] == {ALL: profile.snapshot(60)["models"][ALL]}
    assert profile.snapshot(60)["models"][ALL]["requests"] == 0


def test_the_profiles_kept_requests_leave_nothing_for_the_cyclic_gc_to_walk():
    # A gateway at 1,000 streams runs a full collection every ~250 requests; 50,000 kept requests the GC still
    # tracked made each walk ~14 ms longer (docs/benchmarks.md). Kept as plain tuples, the GC stops
    # tracking them at its first collection.
    profile = WorkloadProfile(clock=Clock())
    rng = random.Random(6)
    prompts = [_ids(rng, 40) for _ in range(100)]
    gc.collect()
    before = len(gc.get_objects())
    for i in range(2000):
        _record(profile, prompts[i % 100], session=f"s{i % 7}" if i % 2 else None)
    gc.collect()
    assert len(gc.get_objects()) - before < 200  # not one per request
    assert profile.snapshot(60)["models"][ALL]["requests"] == 2000  # and the snapshot still reads them all


def test_block_owners_keep_hot_blocks_across_generations():
    owners = BlockOwners(max_blocks=50)
    hot = list(range(1, 21))
    assert owners.classify(hot, "a") == (0, 0)
    for k in range(10):  # cold traffic turns the generations over several times; the hot chain is resent
        owners.classify([10_000 * (k + 1) + i for i in range(30)], f"x{k}")
        assert owners.classify(hot, "b") == (0, 20)


def test_capture_ids_share_a_prefix_within_a_deployment_and_nothing_across():
    rng = random.Random(5)
    system = _ids(rng, 1200)
    one, two = system + _ids(rng, 300), system + _ids(rng, 300)
    a, a_again, a_two = salted_ids(one, "m", "salt-A"), salted_ids(one, "m", "salt-A"), salted_ids(two, "m", "salt-A")
    b = salted_ids(one, "m", "salt-B")
    assert len(a) == -(-len(one) // TRACE_BLOCK_TOKENS) == 3
    assert a == a_again  # a repeat within one deployment matches
    assert a_two[:2] == a[:2] and a_two[2] != a[2]  # two full shared blocks, then the prompts differ
    assert not set(a) & set(b)  # under another salt: unrelated
    assert salted_ids(one, "m", "salt-A", tenant_salt="t") != a  # tenants never share ids
    assert len(salted_ids([7, 8, 9], "m", "salt-A")) == 1  # a prompt shorter than a block still has its id


async def test_capture_records_are_mooncake_records_and_rotate_by_count(tmp_path):
    store = MemoryStore()
    cap = TraceCapture(CaptureConfig(enabled=True, max_records=5), store)
    await cap.flush()  # loads the salt
    rng = random.Random(6)
    for i in range(8):
        cap.record(model="m", prompt_ids=_ids(rng, 700), tenant_salt="", session="s1" if i % 2 else None,
                   output_tokens=9, traffic_class="session", engine="paged", duration_s=0.3, ttft_s=0.1,
                   tpot_s=0.02)
    lines = await cap.export()
    assert len(lines) == 5  # the newest five
    path = tmp_path / "capture.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records = load_trace(path)
    assert [r.input_length for r in records] == [700] * 5 and all(len(r.hash_ids) == 2 for r in records)
    sessions = {r.session for r in records}
    assert "" in sessions and len(sessions) == 2 and "s1" not in "".join(sessions)
    assert json.loads(lines[0])["ttft_ms"] == 100.0


async def test_capture_samples_whole_sessions_and_only_the_configured_models():
    cap = TraceCapture(CaptureConfig(enabled=True, sample_rate=0.5, models=("m",)), MemoryStore())
    await cap.flush()
    assert not cap.wants("other", "s")
    picks = {s: cap.wants("m", s) for s in (f"s{i}" for i in range(200))}
    assert 60 < sum(picks.values()) < 140
    assert all(cap.wants("m", s) == picked for s, picked in picks.items())  # a session is in or out, whole
    with pytest.raises(ValueError):
        CaptureConfig(sample_rate=0).validate()


def test_the_capture_and_profile_config_sections_are_checked():
    from gateway.config import ConfigError, from_dict

    config = from_dict({"capture": {"enabled": True, "sample_rate": 0.5, "models": ["m"], "max_age_s": 3600}})
    assert config.capture == CaptureConfig(enabled=True, sample_rate=0.5, max_age_s=3600, models=("m",))
    assert from_dict({}).capture.enabled is False and from_dict({}).profile is True
    assert from_dict({"profile": {"enabled": False}}).profile is False
    with pytest.raises(ConfigError, match=r"capture: unknown keys \['rate'\]"):
        from_dict({"capture": {"rate": 1}})
    with pytest.raises(ConfigError, match="capture.sample_rate must be in"):
        from_dict({"capture": {"sample_rate": 2}})


def test_a_busy_window_is_read_from_a_sample_with_true_counts():
    clock = Clock()
    profile = WorkloadProfile(clock=clock)
    rng = random.Random(7)
    system = _ids(rng, 320)
    for i in range(10_000):  # every other request repeats a 20-block system prompt; 30 blocks each
        _record(profile, (system if i % 2 else _ids(rng, 320)) + _ids(rng, 160))
    p = profile.snapshot(60)["models"][ALL]
    assert (p["requests"], p["sampled"], p["arrival_rps"]) == (10_000, 2000, pytest.approx(10_000 / 60, abs=0.01))
    assert p["prefix_repetition"]["cross_session"] == pytest.approx(0.5 * 20 / 30, abs=0.02)
    assert sum(p["prompt_tokens"]["histogram"]["counts"]) == 2000


def test_peak_concurrency_counts_the_requests_in_flight_at_once():
    from gateway.control.workload import _ProfileCollector

    clock = Clock()
    t0 = clock.now
    profile = WorkloadProfile(clock=clock)
    # (start, end) in seconds from t0, recorded as they end: three overlap between 4 and 5; D starts as A ends
    spans = {"B": (2, 5), "C": (4, 8), "A": (0, 10), "D": (10, 12), "E": (20, 21)}
    for name, (start, end) in spans.items():
        clock.now = t0 + end
        profile.record(model="x" if name != "E" else "y", session=None, turns=1, hashes=[], prompt_tokens=10,
                       output_tokens=5, traffic_class="oneshot", engine="paged", cached_tokens=0,
                       duration_s=end - start)
    snap = profile.snapshot(60)["models"]
    assert snap[ALL]["concurrency_peak"] == 3 and snap["x"]["concurrency_peak"] == 3
    assert snap["y"]["concurrency_peak"] == 1
    assert snap[ALL]["concurrency_mean"] == pytest.approx(20 / 60, abs=1e-3)  # 20 busy seconds in the minute
    # /metrics: the peak beside the mean
    families = {f.name: f for f in _ProfileCollector(profile).collect()}
    peaks = {s.labels["model"]: s.value for s in families["duet_profile_concurrency_peak"].samples}
    assert peaks == {ALL: 3, "x": 3, "y": 1}
    assert {s.labels["model"] for s in families["duet_profile_concurrency"].samples} == {ALL, "x", "y"}


def test_the_peak_reads_every_request_not_the_sample(monkeypatch):
    import gateway.control.profile as profile_module

    monkeypatch.setattr(profile_module, "SAMPLE", 4)  # every 5th of 20 requests sampled
    clock = Clock()
    profile = WorkloadProfile(clock=clock)
    clock.now += 10
    for _ in range(20):  # 20 requests that all ran from t-10 to t, together
        profile.record(model="m", session=None, turns=1, hashes=[], prompt_tokens=10, output_tokens=5,
                       traffic_class="oneshot", engine="paged", cached_tokens=0, duration_s=10)
    p = profile.snapshot(60)["models"][ALL]
    assert p["sampled"] == 4 and p["concurrency_peak"] == 20


@pytest.mark.parametrize("ttft_s, tpot_s", [(0.1, 0.02), (None, None), (1.23456789, 1e-07), (12.0, None)])
def test_a_capture_line_is_what_json_dumps_writes(ttft_s, tpot_s):
    from gateway.control.capture import _line

    for model, cls, session, ids in (("m", "session", "s-00ff00ff00ff00ff", [1, 2**64 - 1]),
                                     ('we"ird\\ m\u00f6del', "document", "", []), ("tiny-llama-v2", "oneshot", "",
                                                                                  [18446744073709551615])):
        record = {"timestamp": 1733520000123, "input_length": 700, "output_length": 9, "hash_ids": ids,
                  "session": session, "class": cls, "engine": "paged", "model": model,
                  "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 3),
                  "tpot_ms": None if tpot_s is None else round(tpot_s * 1000, 3)}
        line = _line(1733520000123, 700, 9, ids, session, cls, "paged", model, ttft_s, tpot_s)
        assert line == json.dumps(record, separators=(",", ":"))
        assert json.loads(line) == record
