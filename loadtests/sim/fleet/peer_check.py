"""Is a simulated peer the real one? The replay `duet bench routers` ran (loadtests/experiments/routers.py), run again
in the fleet simulator behind the peer's simulated policy (loadtests/sim/fleet/peer_policies.py), and the hit rate
and TTFT p50 of both side by side (issue 45: each within 15%).

The simulated side takes the real one's plan: the same trace records cut to the same prompt and output lengths
(routers.build_requests), the same Poisson arrivals (the client's `poisson_arrivals`, seed 0), the same number
of servers, each sent at its own arrival time (an open-loop client: `chain_sessions=False`). The servers are
simulated as Duet's engine_paged on the `cpu` cost model (fitted on a quiet machine; cpu_cost.json, as
`duet bench fleet --validate` uses it) with the plan's KV budget, each behind the measured gateway path
(the one-worker Duet gateway that fronts each server in the `duet` engines mode). For the `vllm` engines mode
the hit rate compares, but the TTFT does not: the simulator models Duet's engines, not vLLM.

    python -m loadtests.sim.fleet.peer_check --real ROUTERS.json --trace mooncake --requests 150 --rate 2 \\
        --max-prompt-tokens 1024 --max-tokens 16 [--servers 2] [--engines duet] [--model DIR]
        [--kv-cache-tokens N] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from loadtests.sim.fleet.workload import FleetRequest

# `duet bench routers` names -> the simulator's policies (StackSpec.policy)
# (a real router may be shown beside more than one: vllm-router kv_aware as its code means it, and with its index
# never matching, as it ran here)
SIMULATED = {"smg:cache_aware": ("smg_cache_aware",),
             "vllm-router:kv_aware": ("vllm_kv_aware", "vllm_kv_aware_unmatched"),
             "sglang-router:cache_aware": ("sglang",), "duet": ("duet",)}
TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class ReplayedRequest(FleetRequest):
    """A FleetRequest whose prompt is the replay's own token ids (not rebuilt from a trace record)."""

    token_ids: tuple[int, ...] = ()

    def prompt(self, max_model_len: int) -> list[int]:
        return list(self.token_ids[: max_model_len - self.max_tokens])


def fleet_requests(bench_requests, rate: float) -> list[ReplayedRequest]:
    from loadtests.load.client import poisson_arrivals

    arrivals = poisson_arrivals(bench_requests, rate, 0)
    out = [ReplayedRequest(request_id=r.request_id, arrival_s=arrivals[r.request_id], record=None,
                           traffic_class="chat" if r.session_id else "document", session=r.session_id, turn=1,
                           max_tokens=r.max_tokens, token_ids=tuple(r.prompt_token_ids))
           for r in bench_requests]
    return sorted(out, key=lambda r: r.arrival_s)


def simulate(policy: str, requests: list[ReplayedRequest], servers: int, kv_cache_tokens: int) -> dict:
    """One simulated replay: the engines' hit rate (cached over prompt tokens) and TTFT p50."""
    from loadtests.sim.fleet.cost_models import InSituCostModel, LinearCostModel
    from loadtests.sim.fleet.cpu_fit import fit_path
    from loadtests.sim.fleet.engine import EngineProfile
    from loadtests.sim.fleet.gateway_path import GatewayPath
    from loadtests.sim.fleet.simulator import FleetSim, SimSettings, StackSpec

    fit_file = fit_path()  # one file for every figure of the run
    fit = json.loads(fit_file.read_text())
    in_situ = InSituCostModel.from_json(fit_file)
    slowdown = fit["in_situ"]["neighbour_slowdown"] if in_situ else fit.get("neighbour_slowdown", 0.0)
    profile = dataclasses.replace(EngineProfile.for_cost_model("cpu"), kv_cache_tokens=kv_cache_tokens)
    # the front gateway's FIFO and token time; the router sees the servers' live load (it counts in flight)
    path = GatewayPath.from_json(None, fit_file)
    settings = SimSettings(chain_sessions=False, gateway=path, neighbour_slowdown=slowdown)
    sim = FleetSim(StackSpec(policy, ("paged",) * servers, policy), requests, in_situ or LinearCostModel.from_json(fit_file),
                   profile, settings)
    served = [s for s in sim.run() if s.done]
    per_server: dict[str, int] = {}
    for s in served:
        per_server[s.worker_id] = per_server.get(s.worker_id, 0) + 1
    return {"hit_rate": sum(s.cached_tokens for s in served) / max(1, sum(s.prompt_tokens for s in served)),
            "ttft_p50_s": statistics.median(s.ttft_s for s in served), "completed": len(served),
            "per_server": sorted(per_server.values(), reverse=True)}


def compare(real: dict, simulated: dict) -> dict:
    """Relative errors |sim - real| / real, and whether both are within TOLERANCE."""
    def err(a, b):
        return None if not b else round(abs(a - b) / b, 4)

    hit = err(simulated["hit_rate"], real["hit_rate"])
    ttft = err(simulated["ttft_p50_s"], real["ttft_s"]["p50"])
    return {"hit_rate_error": hit, "ttft_p50_error": ttft,
            "within": hit is not None and ttft is not None and hit <= TOLERANCE and ttft <= TOLERANCE}


def check(real_file: Path, plan) -> dict:
    from loadtests.experiments.routers import build_requests

    table = json.loads(real_file.read_text())[plan.trace]
    bench, _allowed = build_requests(plan)
    requests = fleet_requests(bench, table["rate"])
    rows = {}
    for name, real in table["routers"].items():
        if name not in SIMULATED or "skipped" in real:
            continue
        for policy in SIMULATED[name]:
            sim = simulate(policy, requests, plan.servers, plan.kv_cache_tokens)
            rows[f"{name} as {policy}"] = {"real": {"hit_rate": real["hit_rate"], "ttft_p50_s": real["ttft_s"]["p50"],
                                                    "per_server": real.get("per_server")},
                                           "simulated": sim, **compare(real, sim)}
    return {"trace": plan.trace, "rate": table["rate"], "servers": plan.servers, "engines": plan.engines,
            "requests": len(requests), "routers": rows}


def format_table(result: dict) -> str:
    lines = [(f"{result['trace']}: {result['requests']} requests at {result['rate']}/s over {result['servers']} "
              f"{result['engines']} servers"), "",
             "| router | hit rate real / sim (error) | TTFT p50 s real / sim (error) | requests per server real / sim |",
             "|---|---|---|---|"]
    for name, r in result["routers"].items():
        real, sim = r["real"], r["simulated"]
        lines.append(f"| {name} | {real['hit_rate']:.1%} / {sim['hit_rate']:.1%} ({r['hit_rate_error']}) | "
                     f"{real['ttft_p50_s']:.3f} / {sim['ttft_p50_s']:.3f} ({r['ttft_p50_error']}) | "
                     f"{real['per_server']} / {sim['per_server']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from loadtests.experiments.routers import Plan

    p = argparse.ArgumentParser(prog="python -m loadtests.sim.fleet.peer_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", required=True, help="the JSON `duet bench routers --json` wrote")
    p.add_argument("--trace", default="mooncake")
    p.add_argument("--engines", choices=("duet", "vllm"), default="duet")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None, help="the model directory the real run used (its tokenizer)")
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="each server's KV budget (the duet "
                   "engines' default; for vLLM, the token count its log gives)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from duet.model_make import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    plan = Plan(args.engines, args.servers, (), args.trace, args.requests, 1.0, 1, args.max_prompt_tokens,
                args.max_tokens, model, Path("."), kv_cache_tokens=args.kv_cache_tokens)
    result = check(Path(args.real), plan)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
