"""The Router (gateway/serving/router.py) built as a simulator builds it: its record keeps the prefix tables and
the planner's signals exactly as the gateway's does."""

from __future__ import annotations

from gateway.control.pool_tracker import PoolTracker
from gateway.metrics import GatewayMetrics
from gateway.routing.prefix_index import WorkerBlockIndex
from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView
from gateway.serving.router import Router


def _view(wid: str, kind: str, caps: frozenset[str]) -> WorkerView:
    return WorkerView(worker_id=wid, model_id="m", engine_kind=kind, version="v1", capabilities=caps,
                      healthy=True, draining=False, num_running=0, num_waiting=0, kv_usage=0.0)


def test_an_external_engine_with_larger_blocks_is_indexed_by_whole_engine_blocks_only():
    views = [_view("vllm", "paged", frozenset())]
    router = Router(lambda: views, WorkerBlockIndex(), engine_block_tokens={"vllm": 64}.get)
    req = RouteRequest(model="m", block_hashes=tuple(range(10)), num_prompt_tokens=170, block_tokens=16)
    d = router.decide(req, router.views(), RoutingConfig(), None)
    router.record("r1", req, d)
    assert router.index.match("vllm", req.block_hashes) == 8  # two whole 64-token blocks of 16-token hashes
    assert router.seen.estimated_reuse(req.block_hashes) == 1.0  # the gateway has seen all ten


def test_decide_tells_the_planner_a_kind_is_needed_on_the_routers_clock():
    tracker = PoolTracker(GatewayMetrics())
    views = [_view("x0", "prefix", frozenset({"structured_output"}))]
    router = Router(lambda: views, WorkerBlockIndex(), pool_tracker=tracker, clock=lambda: 1000.0)
    req = RouteRequest(model="m", block_hashes=(1,), num_prompt_tokens=20,
                       required_capabilities=frozenset({"structured_output"}))
    router.record("r1", req, router.decide(req, router.views(), RoutingConfig(), None))
    assert tracker.needed(1000.0) == frozenset({"prefix"})
