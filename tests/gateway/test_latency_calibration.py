"""Routing's learned latency correction per worker (gateway/routing/calibration.py): observed over predicted, a ratio of
sums over the worker's recent requests, applied once it has enough of them."""

from __future__ import annotations

import pytest

from gateway.routing.calibration import MIN_SAMPLES, LatencyCalibration
from gateway.routing.prefix_index import WorkerBlockIndex
from gateway.routing.route_types import RouteDecision, WorkerView
from gateway.serving.router import Router


def test_the_correction_is_observed_over_predicted_once_enough_requests_were_seen():
    cal = LatencyCalibration(window=4, min_samples=2)
    assert cal.observe("w", 1.0, 3.0, 0.1, 0.1) == (1.0, 1.0)  # one request: not enough to learn from
    assert cal.observe("w", 3.0, 3.0, 0.1, 0.2) == (pytest.approx(1.5), pytest.approx(1.5))  # 6/4, 0.3/0.2
    assert cal.correction("other") == (1.0, 1.0)
    # a ratio of sums: the long wait weighs more than the short one
    cal.observe("w", 10.0, 10.0)
    assert cal.correction("w").ttft == pytest.approx(16 / 14)


def test_the_window_forgets_old_requests_and_a_missing_figure_is_not_a_sample():
    cal = LatencyCalibration(window=3, min_samples=1)
    for _ in range(3):
        cal.observe("w", 1.0, 4.0)
    for _ in range(3):
        cal.observe("w", 1.0, 1.0, None, 0.5)  # no TPOT predicted: nothing to learn of the TPOT
    assert cal.correction("w") == (1.0, 1.0)
    cal.observe("w", 0.0, 1.0)  # a zero prediction has no ratio
    assert cal.correction("w").ttft == 1.0
    cal.forget("w")
    assert cal.correction("w") == (1.0, 1.0)
    with pytest.raises(ValueError, match="min_samples"):
        LatencyCalibration(window=4, min_samples=5)


def test_the_router_learns_from_what_its_decisions_predicted_and_reports_each_correction():
    views = [WorkerView(worker_id="w0", model_id="m", engine_kind="prefix", version="v1", capabilities=frozenset(),
                        healthy=True, draining=False, num_running=0, num_waiting=0, kv_usage=0.0)]
    seen = []
    router = Router(lambda: views, WorkerBlockIndex(), on_observe=lambda wid, c: seen.append((wid, c)))
    decision = RouteDecision("w0", "prefix", "default", "least_load", 0.0, 0, modelled_ttft_s=0.2,
                             modelled_tpot_s=0.05)
    for _ in range(MIN_SAMPLES):
        router.observe(decision, 0.6, 0.05)
    assert seen[-1] == ("w0", (pytest.approx(3.0), pytest.approx(1.0)))
    assert router.views()[0].ttft_correction == pytest.approx(3.0)
    # a decision without a prediction (no measured rate, or a baseline policy) teaches nothing
    router.observe(RouteDecision("w0", "prefix", "default", "least_load", 0.0, 0), 9.0, 9.0)
    assert len(seen) == MIN_SAMPLES


def _plain(samples) -> float:
    predicted = sum(p for p, _ in samples)
    return sum(o for _, o in samples) / predicted


def test_the_running_sums_give_the_ratio_of_the_plain_sums_over_the_window():
    import random

    from gateway.routing.calibration import _Ratio

    rng = random.Random(45)
    ratio, window = _Ratio(8), []
    for i in range(500):
        # latencies from a millisecond to a minute, as TTFTs under load
        sample = (10 ** rng.uniform(-3, 2), 10 ** rng.uniform(-3, 2))
        ratio.add(*sample)
        window = (window + [sample])[-8:]
        assert ratio.value(1) == pytest.approx(_plain(window), rel=1e-12), i
        if (i + 1) % 8 == 0:  # recounted from the samples: exactly the plain sums
            assert ratio.value(1) == _plain(window)


def test_a_huge_sample_evicted_leaves_no_rounding_residue_behind():
    from gateway.routing.calibration import _Ratio

    ratio = _Ratio(4)
    ratio.add(1e16, 1e16)  # absorbs the small ones' low bits while it is in the sums
    for _ in range(8):
        ratio.add(1.0, 3.0)
    # without the recount the evicted 1e16 would leave the predicted sum at 1 or 3 instead of 4
    assert ratio.value(1) == 3.0


def _correction_lines(metrics_page: str) -> list[str]:
    return [line for line in metrics_page.splitlines()
            if line.startswith(("duet_route_ttft_correction{", "duet_route_tpot_correction{"))]


async def test_a_worker_that_leaves_the_fleet_takes_its_correction_and_its_gauges_with_it(fake_gateway):
    from tests.support.fake_engine import FakeEngine

    static, churner = FakeEngine("prefix", worker_id="static"), FakeEngine("paged", worker_id="churner")
    gw = await fake_gateway(static)
    fleet, router = gw.gateway.fleet, gw.gateway.router
    # the registry's worker gets its fake client where the gateway's client factory would dial it
    dial = fleet._client_factory
    fleet._client_factory = lambda address: churner.client if address == churner.address else dial(address)
    registration = {"worker_id": "churner", "address": churner.address}

    def serving(worker_id: str) -> bool:
        return any(v.worker_id == worker_id and v.healthy for v in router.views())

    await gw.gateway.state.register_worker(registration, ttl_s=3600)
    assert await gw.wait_for(lambda: serving("churner"))
    for worker_id in ("static", "churner"):
        decision = RouteDecision(worker_id, "paged", "default", "least_load", 0.0, 0, modelled_ttft_s=0.2,
                                 modelled_tpot_s=0.05)
        for _ in range(MIN_SAMPLES):
            router.observe(decision, 0.6, 0.1)
    assert {v.worker_id: v.ttft_correction for v in router.views()} == {"static": pytest.approx(3.0),
                                                                         "churner": pytest.approx(3.0)}
    lines = _correction_lines((await gw.http.get("/metrics")).text)
    assert sorted(line.split("}")[0] for line in lines) == [
        'duet_route_tpot_correction{worker="churner"', 'duet_route_tpot_correction{worker="static"',
        'duet_route_ttft_correction{worker="churner"', 'duet_route_ttft_correction{worker="static"']

    await gw.gateway.state.register_worker(registration, ttl_s=0)  # its registration lapses: it left
    assert await gw.wait_for(lambda: fleet.get("churner") is None)
    lines = _correction_lines((await gw.http.get("/metrics")).text)
    assert sorted(line.split("}")[0] for line in lines) == [
        'duet_route_tpot_correction{worker="static"', 'duet_route_ttft_correction{worker="static"']
    assert router.calibration.correction("churner") == (1.0, 1.0)

    await gw.gateway.state.register_worker(registration, ttl_s=3600)  # back: a new worker, the model as it is
    assert await gw.wait_for(lambda: serving("churner"))
    assert {v.worker_id: v.ttft_correction for v in router.views()} == {"static": pytest.approx(3.0),
                                                                         "churner": 1.0}
    assert not any("churner" in line for line in _correction_lines((await gw.http.get("/metrics")).text))


async def test_an_address_that_restarts_as_another_worker_forgets_the_old_one():
    # `duet up --workers` switches a worker's engine kind on the same address: the old id leaves the fleet
    from duet.rpc import engine_pb2 as pb
    from gateway.backends.fleet import Fleet
    from gateway.metrics import GatewayMetrics

    class Client:
        healthy, info = True, pb.EngineInfo(worker_id="old", engine_kind="paged", model_id="m")

        async def check_health(self, timeout=None) -> bool:
            return self.healthy

        async def get_info(self, timeout=None) -> pb.EngineInfo:
            return self.info

        async def get_load(self, timeout=None) -> pb.EngineLoad:
            return pb.EngineLoad()

        async def watch_kv_events(self):
            from gateway.backends.engine_client import EngineCallError

            raise EngineCallError("w", "UNIMPLEMENTED", "no events", False)
            yield

        async def close(self) -> None:
            pass

    client = Client()
    fleet = Fleet(("a:1",), WorkerBlockIndex(), GatewayMetrics(), client_factory=lambda address: client)
    gone: list[str] = []
    fleet.on_gone.append(gone.append)
    await fleet.start()
    try:
        await fleet.poll_once()
        assert gone == [] and fleet.get("old") is not None
        client.healthy = False  # it stops, and comes back as another worker
        await fleet.poll_once()
        client.healthy, client.info = True, pb.EngineInfo(worker_id="new", engine_kind="prefix", model_id="m")
        await fleet.poll_once()
        assert gone == ["old"] and fleet.get("new") is not None
    finally:
        await fleet.close()
    assert gone == ["old", "new"]  # closing the fleet lets every worker go
