"""`GatewayAdmin`: the running gateway as the admin API reads it, the `AdminBackend` of
gateway/control/admin.py (the served models, the state store, the stats and decisions, the rollback
controller, the shadow's books, one row per worker, draining, the pool planner's report, and each side's
sampling defaults for a shadow run). gateway/app.py builds it."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gateway.backends.fleet import Fleet
from gateway.config import GatewayConfig
from gateway.control.pool_tracker import PoolTracker
from gateway.control.rollback import RollbackController
from gateway.control.sampling_defaults import differences, engine_defaults
from gateway.control.shadow import ShadowConfig, ShadowLedger
from gateway.control.shadow_sync import ShadowSync
from gateway.control.state import StateStore
from gateway.control.stats import RequestStats
from gateway.models import ServedModel
from gateway.routing.decision_log import DecisionLog
from gateway.routing.route_types import Pool


@dataclass(frozen=True)
class GatewayAdmin:
    config: GatewayConfig  # the admin key, and the routing config a model has until one is set
    models: Mapping[str, ServedModel]
    state: StateStore
    stats: RequestStats
    decisions: DecisionLog
    rollback: RollbackController
    fleet: Fleet
    pool_tracker: PoolTracker
    shadow: ShadowLedger
    shadow_sync: ShadowSync  # the shadow configs every replica shares (the state store's)

    @property
    def admin_key(self) -> str | None:
        return self.config.admin_key

    def model_ids(self) -> list[str]:
        return list(self.models)

    def worker_rows(self) -> list[dict]:
        """One row per worker; `engine` says what serves it (duet: Duet's own worker; vllm, sglang, openai: an
        external backend) and the two rates are its measured ones while busy (0.0: none yet): the engine's own
        (Duet's GetLoad, a vLLM server's /metrics counters: gateway/backends/backend_load.py), else the prefill
        rate this gateway saw (pool_tracker.py; `prefill_rate_source` says which). `duet bench advise
        --from-gateway` calibrates an external kind's step costs from them (loadtests/advise/calibrated.py)."""
        external = {b.url: b.engine for b in self.config.backends}
        rows = []
        for w in self.fleet.workers():
            load, info = w.load, w.info
            queries = load.prefix_cache_queries_tokens if load else 0
            prefill = load.prefill_tokens_per_s if load else 0.0
            observed = 0.0 if prefill > 0 else self.pool_tracker.prefill_rate(w.worker_id)
            rows.append({
                "worker_id": w.worker_id, "address": w.address,
                "model_id": info.model_id if info else "", "engine_kind": info.engine_kind if info else "",
                "version": info.version if info else "", "healthy": w.healthy,
                "draining": w.worker_id in self.fleet.drained or bool(load and load.draining),
                "num_running": load.num_running if load else 0,
                "num_waiting": load.num_waiting if load else 0,
                "kv_usage": load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0,
                "prefix_hit_rate": load.prefix_cache_hits_tokens / queries if queries else 0.0,
                "num_preemptions": load.num_preemptions if load else 0,
                "reused_pages_evicted": load.reused_pages_evicted if load else 0,
                "engine": external.get(w.address, "duet"),
                "page_size": info.page_size if info else 0, "max_model_len": info.max_model_len if info else 0,
                "prefill_tokens_per_s": prefill or observed,
                "prefill_rate_source": "engine" if prefill > 0 else "gateway" if observed > 0 else "",
                "decode_tokens_per_s": load.decode_tokens_per_s if load else 0.0,
                # the batch that decode rate was measured at: an HTTP backend's BusyRates (backend_load.py) keep it;
                # GetLoad has no field for it, so Duet's own workers' rows say 0 (unknown)
                "decode_tokens_per_step": getattr(w.client, "decode_tokens_per_step", 0.0),
            })
        return rows

    def drain_worker(self, worker_id: str) -> bool:
        return self.fleet.drain(worker_id)

    def pool_report(self) -> dict:
        """The pool planner's report (gateway/control/pool_tracker.PoolTracker.report)."""
        return self.pool_tracker.report(time.monotonic())

    def sampling_defaults(self, config: ShadowConfig, live: tuple[Pool, ...] = ()) -> dict:
        """Each side's sampling defaults for a request that leaves a field unset (the candidate's pools against
        the `live` pools, those with traffic; none: every other worker of the model), and the fields where they
        differ (gateway/control/sampling_defaults.py)."""
        external = {b.url: b.engine for b in self.config.backends}
        generation = _generation_config(self.config.model_paths, config.model)
        sides: dict[str, dict] = {"primary": {}, "candidate": {}}
        for w in self.fleet.workers():
            view = w.view()
            if view is None or view.model_id != config.model:
                continue
            engine = external.get(w.address, view.engine_kind)
            label = f"{engine}@{view.version}"
            if config.holds(view):
                sides["candidate"][label] = engine_defaults(engine, generation)
            elif not live or any(p.holds(view) for p in live):
                sides["primary"][label] = engine_defaults(engine, generation)
        return {**sides, "differences": differences(sides["primary"], sides["candidate"])}


def _generation_config(model_paths, model: str) -> dict:
    """The model's generation_config.json (what vLLM and SGLang apply to unset fields); {} when none."""
    for path in model_paths:
        file = Path(path) / "generation_config.json"
        if Path(path).resolve().name == model and file.is_file():
            try:
                return json.loads(file.read_text())
            except (OSError, ValueError):
                return {}
    return {}
