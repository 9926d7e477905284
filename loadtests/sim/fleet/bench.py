"""`duet bench fleet`: the stacks of one fleet size on one workload, in the fleet simulator.

Stacks (each the same N workers, the same engine profile and cost model):
    all_paged     N engine_paged workers behind the SGLang-style cache-aware router (as `duet bench compare`)
    all_prefix    N engine_prefix workers behind the same router
    duet_planner  Duet's routing and pool planner, starting from N/2 + N/2 (the planner may go to zero of a kind)
    duet_P:Q      a fixed split behind Duet's routing (`--split 16:16`, several allowed)
    paged_duet_routing, prefix_duet_routing   (on request) one kind behind Duet's routing: the routing's share
    smg_cache_aware, vllm_kv_aware, llmd_default   (on request) N engine_prefix workers behind a peer router's
                  policy, written from its code (loadtests/sim/fleet/peer_policies.py)

Each stack's figures are loadtests/sim/fleet/report.py's (goodput, SLO attainment, TTFT/TPOT p50/p99 per class),
plus `goodput_ratio_vs_best_homogeneous`. With `--find-rate`, the rate is first set to the one at which the
best homogeneous stack meets its SLOs for `--attainment` (0.9) of requests (bisection on the rate multiplier),
and every stack also gets `capacity_rate` (the highest multiplier at which IT meets that attainment) and
`capacity_ratio_vs_best_homogeneous`.

`contest` (`--contest`, issue 45): for each peer stack asked for, the rate at which IT meets its SLOs for
`--attainment` of requests (bisection, as --find-rate), then the peer and Duet's routing over the same
workers (`prefix_duet_routing`) at that rate: Duet's goodput over the peer's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from duet.contract import ENGINE_KINDS
from gateway.control.pool_planner import PlannerConfig
from gateway.routing.route_types import RoutingConfig
from loadtests.load.class_slo import COST_MODEL_PROFILES, FLEET_SLOS, ClassSlo
from loadtests.sim.fleet.cost_models import COST_MODELS, cost_model
from loadtests.sim.fleet.engine import EngineProfile
from loadtests.sim.fleet.peer_policies import PEER_POLICIES, VARIANTS
from loadtests.sim.fleet.report import add_ratios, summarize
from loadtests.sim.fleet.simulator import FleetSim, SimSettings, StackSpec
from loadtests.sim.fleet.workload import CLASSES, build

STACKS = ("all_paged", "all_prefix", "duet_planner")
# one kind behind Duet's routing: what the routing alone is worth, without a second engine kind (shown, not
# counted as a homogeneous baseline: the baselines run behind the SGLang-style router, as in duet bench compare)
ROUTING_ONLY = ("paged_duet_routing", "prefix_duet_routing")
PEERS = PEER_POLICIES + VARIANTS  # N engine_prefix workers behind a peer's policy (the engines the peers front cache prefixes)
CALIBRATED = "calibrated"  # FleetSettings.cost_model when step costs come from measured rates (`calibration`)
DUET_ROUTING = "prefix_duet_routing"  # the same workers behind Duet's routing: what --contest compares each peer to


@dataclass(frozen=True)
class FleetSettings:
    cost_model: str = "h200"
    workers: int = 32
    mix: dict = field(default_factory=lambda: {"mooncake": 1.0, "azure_code": 1.0})
    window_s: float = 300.0  # trace seconds taken from each source
    rate: float = 1.0  # arrival-rate multiplier
    stacks: tuple[str, ...] = STACKS
    splits: tuple[tuple[int, int], ...] = ()
    slos: ClassSlo | None = None  # None: FLEET_SLOS[cost_model]
    max_output_tokens: int | None = None
    switch_s: float | None = None  # None: 20 s (h200) / 3 s (cpu)
    planner_window_s: float | None = None  # the planner's rate window and cooldown; None: the gateway's 30 s
    attainment: float = 0.9
    rate_range: tuple[float, float] = (1.0, 16.0)  # --find-rate searches multipliers in here
    search_steps: int = 5  # bisections: the bracket ends (hi/lo)^(1/2^steps) wide, 1.09x for the defaults
    # step costs, engine profile and SLOs calibrated from measured backend rates (loadtests/advise/calibrated.py
    # `Calibration`), in place of a named cost model: cost_model is then CALIBRATED
    calibration: object | None = None
    # a session's next turn not before the previous answer (SimSettings.chain_sessions); False: every request at its
    # own arrival time, as an open-loop client sends it (advise --validate: what its local replay sends)
    chain_sessions: bool = True

    def validate(self) -> FleetSettings:
        if self.calibration is not None:
            if self.cost_model != CALIBRATED or self.slos is None:
                raise ValueError("a calibration goes with cost_model 'calibrated' and its own SLO table")
        elif self.cost_model not in COST_MODELS:
            raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, got {self.cost_model!r}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        known = STACKS + ROUTING_ONLY + PEERS
        unknown = [s for s in self.stacks if s not in known]
        if unknown:
            raise ValueError(f"--stacks: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        if "duet_planner" in self.stacks and self.workers < 2:
            raise ValueError("duet_planner needs --workers >= 2 (it starts with one of each kind)")
        for p, q in self.splits:
            if p < 0 or q < 0 or p + q != self.workers:
                raise ValueError(f"--split {p}:{q}: the two counts must be >= 0 and add up to --workers "
                                 f"{self.workers}")
        if self.search_steps < 0:
            raise ValueError(f"--search-steps must be >= 0, got {self.search_steps}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")
        return self


    def slo_table(self) -> ClassSlo:
        return self.slos or FLEET_SLOS[self.cost_model]

    def slo_profile(self) -> str:
        """The traffic-class table's profile the deployment is judged by (duet/traffic_classes.py): the cost model's
        hardware's, or a calibration's (the gateway's routing config)."""
        return self.calibration.slo_profile if self.calibration is not None else COST_MODEL_PROFILES[self.cost_model]

    def engine_profile(self) -> EngineProfile:
        return self.calibration.profile if self.calibration is not None else EngineProfile.for_cost_model(self.cost_model)

    def step_cost_model(self):
        return self.calibration.cost_model if self.calibration is not None else cost_model(self.cost_model)


def parse_split(text: str) -> tuple[int, int]:
    p, sep, q = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(p), int(q)
    except ValueError:
        raise ValueError(f"--split {text!r}: expected PAGED:PREFIX worker counts, e.g. 16:16") from None


def specs(s: FleetSettings) -> list[StackSpec]:
    n = s.workers
    out = []
    for name in s.stacks:
        if name == "all_paged":
            out.append(StackSpec(name, ("paged",) * n, "sglang"))
        elif name == "all_prefix":
            out.append(StackSpec(name, ("prefix",) * n, "sglang"))
        elif name in ROUTING_ONLY:
            out.append(StackSpec(name, (name.split("_")[0],) * n, "duet"))
        elif name in PEERS:
            out.append(StackSpec(name, ("prefix",) * n, name))
        else:
            out.append(StackSpec(name, ("paged",) * (n // 2) + ("prefix",) * (n - n // 2), "duet", planner=True))
    for p, q in s.splits:
        out.append(StackSpec(f"duet_{p}:{q}", ("paged",) * p + ("prefix",) * q, "duet"))
    return out


def stack_sim(spec: StackSpec, s: FleetSettings, rate: float | None = None) -> tuple[FleetSim, list]:
    """(the simulator, its requests) of one run of `spec` (run_stack's; advise --validate's --per-request replays the
    recommended option through it: the run is deterministic)."""
    profile = s.engine_profile()
    requests = build(s.mix, s.window_s, s.rate if rate is None else rate, profile.max_model_len,
                     max_output_tokens=s.max_output_tokens)
    planner = PlannerConfig()
    if s.planner_window_s is not None:
        planner = replace(planner, window_s=s.planner_window_s, cooldown_s=s.planner_window_s).validate()
    # Duet's routing as a deployment on this hardware configures it: the class SLOs of its profile, and the
    # engines' step budget
    routing = RoutingConfig(slo_profile=s.slo_profile(), step_tokens=profile.max_num_batched_tokens)
    settings = SimSettings(routing=routing, planner=planner, chain_sessions=s.chain_sessions,
                           switch_s=s.switch_s if s.switch_s is not None else (20.0 if profile.device == "cuda" else 3.0))
    return FleetSim(spec, requests, s.step_cost_model(), profile, settings), requests


def run_stack(spec: StackSpec, s: FleetSettings, rate: float | None = None) -> dict:
    sim, requests = stack_sim(spec, s, rate)
    started = time.perf_counter()
    served = sim.run()
    span = max(1e-9, requests[-1].arrival_s - requests[0].arrival_s)
    out = summarize(served, s.slo_table(), span, len(requests))
    counts = {k: sum(1 for w in sim.workers.values() if w.kind == k) for k in ENGINE_KINDS}
    out["workers"] = {"start": {k: spec.kinds.count(k) for k in ENGINE_KINDS}, "end": counts}
    out["rate"] = s.rate if rate is None else rate
    out["offered_rps"] = round(len(requests) / span, 4)
    out["virtual_s"] = round(sim.now, 2)
    out["sim_wall_s"] = round(time.perf_counter() - started, 2)
    out["steps"] = sum(w.runner.steps for w in sim.workers.values())
    out["preemptions"] = sum(w.core.scheduler.load().num_preemptions for w in sim.workers.values())
    if spec.planner:
        out["planner_switches"] = sim.switches
    return out


def capacity_rate(spec: StackSpec, s: FleetSettings, runs: dict | None = None, progress=None) -> float:
    """The highest rate multiplier (geometric bisection over `s.rate_range`) at which `spec` meets the
    attainment (the low end when it misses there too, the high end when it meets it there). `runs`, when
    given, keeps every run by rate (the contest reuses the one at the rate found)."""
    def attains(rate: float) -> bool:
        r = run_stack(spec, s, rate)
        if runs is not None:
            runs[rate] = r
        if progress:
            progress(f"{spec.name} at x{rate:.3f}: attainment {r['slo_attainment']}, goodput {r['goodput_rps']} req/s")
        return r["slo_attainment"] >= s.attainment

    lo, hi = s.rate_range
    if not attains(lo):
        return lo
    for _ in range(s.search_steps):
        mid = (lo * hi) ** 0.5
        if attains(mid):
            lo = mid
        else:
            hi = mid
    return lo


def run(s: FleetSettings, find_rate: bool = False, progress=None) -> dict:
    s.validate()
    all_specs = specs(s)
    capacities = {}
    if find_rate:
        for spec in all_specs:
            if spec.name not in STACKS:
                continue  # fixed splits are run at the found rate, not searched
            capacities[spec.name] = round(capacity_rate(spec, s), 3)
            if progress:
                progress(f"{spec.name}: meets {s.attainment:.0%} of SLOs up to rate x{capacities[spec.name]}")
        homogeneous = [capacities[k] for k in ("all_paged", "all_prefix") if k in capacities]
        if homogeneous:
            s = replace(s, rate=max(homogeneous))
    stacks = {}
    for spec in all_specs:
        stacks[spec.name] = run_stack(spec, s)
        if progress:
            r = stacks[spec.name]
            progress(f"{spec.name}: goodput {r['goodput_rps']} req/s, attainment {r['slo_attainment']}, "
                     f"{r['sim_wall_s']} s")
    add_ratios(stacks)
    if capacities:
        best = max((capacities[k] for k in ("all_paged", "all_prefix") if k in capacities), default=None)
        for name, r in stacks.items():
            if name in capacities:
                r["capacity_rate"] = capacities[name]
                r["capacity_ratio_vs_best_homogeneous"] = round(capacities[name] / best, 4) if best else None
    return {"cost_model": s.cost_model, "workers": s.workers, "mix": s.mix, "window_s": s.window_s,
            "rate": s.rate, "attainment": s.attainment,
            "slos": s.slo_table().describe(CLASSES),
            "stacks": stacks}


def contest(s: FleetSettings, progress=None) -> dict:
    """Each peer stack in `s.stacks` against Duet's routing over the same workers, at the rate where the peer
    meets `s.attainment` of its SLOs (module doc)."""
    s.validate()
    peers = [spec for spec in specs(s) if spec.name in PEERS]
    if not peers:
        raise ValueError(f"--contest needs at least one peer in --stacks ({', '.join(PEERS)})")
    duet = next(spec for spec in specs(replace(s, stacks=(DUET_ROUTING,), splits=())))
    rows = {}
    for spec in peers:
        runs: dict[float, dict] = {}
        rate = capacity_rate(spec, s, runs, progress)
        peer, mine = runs[rate], run_stack(duet, s, rate)
        rows[spec.name] = {"rate": round(rate, 3), "peer": peer, "duet": mine,
                           "goodput_ratio": round(mine["goodput_rps"] / peer["goodput_rps"], 4)
                           if peer["goodput_rps"] > 0 else None}
        if progress:
            progress(f"{spec.name}: meets {s.attainment:.0%} up to x{rate}; there goodput {peer['goodput_rps']} "
                     f"req/s against Duet's {mine['goodput_rps']} ({rows[spec.name]['goodput_ratio']}x)")
    best = max(rows, key=lambda k: (rows[k]["rate"], rows[k]["peer"]["goodput_rps"]))
    return {"cost_model": s.cost_model, "workers": s.workers, "mix": s.mix, "window_s": s.window_s,
            "attainment": s.attainment, "slos": s.slo_table().describe(CLASSES),
            "duet_stack": DUET_ROUTING, "best_peer": best, "peers": rows}
