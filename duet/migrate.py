"""`duet migrate plan|shadow|canary|status`: the move to another engine, one step at a time, on a running stack.

Each step reads the gateway's admin API (the admin key from --admin-key or DUET_ADMIN_KEY), prints what it
saw, does its one thing, and prints the next step:

    plan     the deployment (workers by pool), the model's routing, any shadow and canary; then, when this
             build has `duet bench advise`, its answer on the gateway's capture of this model's traffic (the
             fleet simulator at the model's worker count: the recommended deployment, its predicted figures,
             the answer at half and double the traffic, and the move's steps)
    shadow   gives the candidate pools a variant of weight 0 (no live traffic), then starts the shadow run
             (`PUT /admin/models/{model}/shadow`): a share of live requests mirrored there, answers dropped
    canary   `POST /admin/models/{model}/canary/start`: refused (exit 1, with the failed bounds) until the
             shadow's figures pass its gates; then the canary ramps under the rollback controller
    status   the shadow's figures beside the primary's (overall and per class), the gate verdict, the
             sampling-default differences, the canary's ramp step, promotion or rollback

The gateway does the work; this is a client of its admin API (gateway/control/migration.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

CANDIDATE_VARIANT = "candidate"  # the variant `shadow` writes for the candidate's pools
PRIMARY_VARIANT = "primary"  # and for the rest, when the model had no variants


class MigrateError(Exception):
    """A step that cannot go on: the message says why (exit 1)."""


class Admin:
    def __init__(self, url: str, key: str | None, timeout_s: float = 10.0) -> None:
        if not key:
            raise MigrateError("the admin key is required: --admin-key or DUET_ADMIN_KEY")
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {key}"})

    def call(self, method: str, path: str, body=None) -> dict:
        try:
            r = self.http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise MigrateError(f"{method} {path}: the gateway did not answer ({e})") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise MigrateError(f"{method} {path} -> {r.status_code}: {message}")
        return r.json()


def _pool(text: str) -> dict:
    kind, _, version = text.partition("@")
    if not kind:
        raise argparse.ArgumentTypeError(f"a pool is KIND@VERSION (e.g. paged@v2), got {text!r}")
    return {"engine_kind": kind, "version": version or "*"}


def _ramp(text: str) -> list[dict]:
    steps = []
    for part in text.split(","):
        weight, _, hold = part.partition(":")
        try:
            steps.append({"weight": float(weight), "hold_s": float(hold)})
        except ValueError:
            raise argparse.ArgumentTypeError(f"a ramp is WEIGHT:HOLD_S,... (e.g. 10:60,50:120,100:120), "
                                             f"got {text!r}") from None
    return steps


def _name(pool: dict) -> str:
    return f"{pool['engine_kind']}@{pool['version']}"


def _in_pool(pool: dict, worker: dict) -> bool:
    return worker["engine_kind"] == pool["engine_kind"] and pool["version"] in ("*", worker["version"])


def _model(admin: Admin, asked: str | None) -> tuple[str, list[dict]]:
    workers = admin.call("GET", "/admin/workers")["workers"]
    models = sorted({w["model_id"] for w in workers if w["model_id"]})
    if asked is None:
        if len(models) != 1:
            raise MigrateError(f"say which model with --model (served: {', '.join(models) or 'none'})")
        asked = models[0]
    return asked, [w for w in workers if w["model_id"] == asked]


def _print_deployment(model: str, workers: list[dict], routing: dict) -> None:
    print(f"model {model}: {len(workers)} workers")
    pools: dict[str, list[dict]] = {}
    for w in workers:
        pools.setdefault(f"{w['engine_kind']}@{w['version']}", []).append(w)
    for name, members in sorted(pools.items()):
        healthy = sum(1 for w in members if w["healthy"] and not w["draining"])
        print(f"  pool {name}: {len(members)} workers, {healthy} serving ({', '.join(w['worker_id'] for w in members)})")
    if not routing["variants"]:
        print("  routing: no variants (every pool takes live traffic)")
    for v in routing["variants"]:
        print(f"  variant {v['name']}: weight {v['weight']:g}, pools {', '.join(map(_name, v['pools']))}")


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_figures(report: dict) -> None:
    rows = [("overall", report["primary"], report["shadow"])]
    rows += [(cls, sides["primary"], sides["shadow"]) for cls, sides in report["by_class"].items()]
    print(f"  {'class':<10} {'side':<8} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'greedy agree':>13}")
    for cls, primary, shadow in rows:
        for side, f in (("primary", primary), ("shadow", shadow)):
            agree = "" if side == "primary" else (
                "-" if f["greedy_agreement"] is None else f"{f['greedy_agreement']:.0%} of {f['greedy_compared']}")
            print(f"  {cls:<10} {side:<8} {f['requests']:>8} {f['errors']:>6} {_ms(f['ttft_p50_ms']):>9} "
                  f"{_ms(f['ttft_p99_ms']):>9} {_ms(f['tpot_p50_ms']):>9} {_ms(f['tpot_p99_ms']):>9} {agree:>13}")
    print("  (latencies in ms; the primary's TTFT counts from arrival at the gateway, the shadow's from its copy)")


def _print_shadow(answer: dict) -> None:
    report = answer["shadow"]
    if report is None:
        print("shadow: none running")
        return
    config = report["config"]
    print(f"shadow: candidate {', '.join(map(_name, config['pools']))}, share {config['share']:.0%}, "
          f"at most {config['max_concurrency']} copies in flight, figures over {config['window_s']:g} s")
    dropped = {k: v for k, v in report["dropped"].items() if v}
    print(f"  in flight {report['in_flight']}; dropped: "
          f"{', '.join(f'{v} ({k})' for k, v in dropped.items()) if dropped else 'none'}")
    _print_figures(report)
    verdict = report["verdict"]
    if verdict["passed"]:
        print("  gates: passed")
    else:
        for line in verdict["failures"]:
            print(f"  gate failed: {line}")
        if verdict["waiting_for"]:
            print(f"  gates: waiting for {verdict['waiting_for']}")
    defaults = answer.get("sampling_defaults") or {}
    diffs = defaults.get("differences") or []
    if not diffs:
        print("  sampling defaults: the same on both sides for fields a request leaves unset")
    for d in diffs:
        print(f"  sampling default differs: {d['field']}: primary {d['primary']}, candidate {d['candidate']}")


def _print_canary(answer: dict) -> None:
    policy = answer["policy"]
    if policy is None:
        print("canary: no policy")
        return
    ramp = ", ".join(f"{s['weight']:g}% for {s['hold_s']:g} s" for s in policy["ramp"]) or "none"
    state = "promoted" if answer.get("promoted") else "rolled back" if answer["rolled_back"] else (
        f"ramp step {answer['ramp_step'] + 1}/{len(policy['ramp'])}" if answer["ramp_step"] >= 0 else "not started")
    print(f"canary: {policy['canary']} vs {policy['baseline']}, ramp {ramp}: {state}"
          f"{' (breaching)' if answer['breaching'] else ''}; gates {'on' if policy.get('gates') else 'off'}")


def _advise_available() -> bool:
    """Whether this build's `duet bench advise` reads traffic from a gateway (`--from-gateway`)."""
    try:
        from loadtests.cli import build_parser
    except ImportError:  # an install without the load tests
        return False
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction) and "advise" in action.choices:
            return any("--from-gateway" in a.option_strings for a in action.choices["advise"]._actions)
    return False


def advise_capture(args, model: str, workers: int) -> dict | str:
    """`duet bench advise --from-gateway` on the capture's records of `model` (loadtests/advise/fleet.py) at
    `--workers` (default: the model's own count, at least 2); or why there is no advice."""
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from duet.capture_export import CaptureExportError, fetch_capture
    from loadtests.advise import fleet
    from loadtests.sim.fleet.bench import FleetSettings

    try:
        text = fetch_capture(args.gateway, args.admin_key)
    except CaptureExportError as e:
        return str(e)
    lines = [line for line in text.splitlines() if line.strip() and json.loads(line).get("model") == model]
    if not lines:
        return "nothing of this model captured yet: send traffic, then plan again"
    with tempfile.TemporaryDirectory(prefix="duet-migrate-plan-") as tmp:
        path = Path(tmp) / "capture.jsonl"
        path.write_text("\n".join(lines) + "\n")
        n = args.workers or max(2, workers)
        mix = {str(path): 1.0}
        try:
            settings = FleetSettings(cost_model=args.cost_model or "h200", workers=n, mix=mix, window_s=args.window_s)
            if args.cost_model is None:  # vLLM / SGLang backends served it: their measured rates make the model
                from loadtests.advise.calibrated import NoMeasuredRate, from_gateway
                from loadtests.sim.fleet.bench import CALIBRATED

                try:
                    cal = from_gateway(args.gateway, args.admin_key, mix)
                except NoMeasuredRate as e:
                    return str(e)  # no advice yet, and the plan goes on (as with nothing captured)
                if cal is not None:
                    settings = replace(settings, cost_model=CALIBRATED, slos=cal.slos, calibration=cal)
                    for kind, r in cal.rates.items():
                        print(f"advice: {kind} step costs {r.source()}")
            print(f"advice: {len(lines)} captured requests of {model} in the fleet simulator, {n} workers, cost model "
                  f"{settings.cost_model} ...", flush=True)
            return fleet.advise(settings)
        except ValueError as e:
            raise MigrateError(f"advice: {e}") from None


def _print_advice(advice: dict | str) -> None:
    if isinstance(advice, str):
        print(f"advice: none: {advice}")
        return
    rec = advice["recommendation"]
    option = advice["rates"]["traffic"]["options"][rec["deployment"]]
    print(f"advice: run {rec['deployment']} ({rec['split']['paged']} paged + {rec['split']['prefix']} prefix, "
          f"{rec['router']} router): predicted goodput {option['goodput_rps']} req/s, "
          f"{option['slo_attainment']:.1%} within the SLOs, TTFT p50 {option['ttft_p50_s']} s, "
          f"p99 {option['ttft_p99_s']} s")
    print(f"  why: {rec['why']}")
    print("  at half and double the traffic: " + ", ".join(
        f"{label.replace('_', ' ')} -> {answer}" for label, answer in advice["sensitivity"].items()))
    canary = advice.get("canary")
    if canary and canary["needed"]:
        print(f"  the move (now served by {' + '.join(advice['served_by'])}):")
        for i, step in enumerate(canary["steps"], 1):
            print(f"    {i}. {step}")
    elif canary:
        print(f"  no move: {canary['why']}")


def plan(admin: Admin, args) -> int:
    model, workers = _model(admin, args.model)
    routing = admin.call("GET", f"/admin/models/{model}/routing")
    _print_deployment(model, workers, routing)
    _print_shadow(admin.call("GET", f"/admin/models/{model}/shadow"))
    _print_canary(admin.call("GET", f"/admin/models/{model}/canary-policy"))
    if _advise_available():
        if args.advise:
            _print_advice(advise_capture(args, model, len(workers)))
        print("next: `duet migrate shadow --candidate KIND@VERSION` mirrors a share of live traffic to the "
              "recommended pool")
    else:
        print("(this build has no `duet bench advise --from-gateway`: the plan reads the deployment and the "
              "shadow state only)")
        print("next: `duet migrate shadow --candidate KIND@VERSION` mirrors a share of live traffic to a pool "
              "that takes none now")
    return 0


def shadow(admin: Admin, args) -> int:
    model, workers = _model(admin, args.model)
    routing = admin.call("GET", f"/admin/models/{model}/routing")
    _print_deployment(model, workers, routing)
    candidate = args.candidate
    held = [w for w in workers if any(_in_pool(p, w) for p in candidate)]
    if not held:
        raise MigrateError(f"no worker of {model} is in {', '.join(map(_name, candidate))}")
    variants = routing["variants"]
    if not variants:
        rest = sorted({(w["engine_kind"], w["version"]) for w in workers if w not in held})
        if not rest:
            raise MigrateError("every worker is in the candidate pools: nothing would serve live traffic")
        variants = [{"name": PRIMARY_VARIANT, "weight": 100,
                     "pools": [{"engine_kind": k, "version": v} for k, v in rest]}]
    else:
        variants = [v for v in variants if v["name"] != CANDIDATE_VARIANT or v["weight"] > 0]
    live = [v for v in variants if v["weight"] > 0 and any(_in_pool(p, w) for p in v["pools"] for w in held)]
    if live:
        raise MigrateError(f"variant {live[0]['name']} sends live traffic to the candidate's workers: "
                           f"take them out of it first")
    variants.append({"name": CANDIDATE_VARIANT, "weight": 0, "pools": candidate})
    new_routing = {**routing, "variants": variants}
    if new_routing != routing:
        print(f"routing: variant {CANDIDATE_VARIANT} ({', '.join(map(_name, candidate))}) at weight 0, "
              f"so it takes no live traffic")
        admin.call("PUT", f"/admin/models/{model}/routing", new_routing)
    body = {"pools": candidate, "share": args.share, "max_concurrency": args.max_concurrency,
            "window_s": args.window_s, "max_loop_lag_ms": args.max_loop_lag_ms}
    if args.gates is not None:
        body["gates"] = args.gates
    answer = admin.call("PUT", f"/admin/models/{model}/shadow", body)
    print(f"shadow started: {args.share:.0%} of {model}'s requests mirrored to {', '.join(map(_name, candidate))}")
    _print_shadow(answer)
    print("next: `duet migrate status` until the gates pass, then `duet migrate canary`")
    return 0


def canary(admin: Admin, args) -> int:
    model, _ = _model(admin, args.model)
    report = admin.call("GET", f"/admin/models/{model}/shadow")
    _print_shadow(report)
    body = {k: v for k, v in (("ramp", args.ramp), ("window_s", args.window_s), ("min_requests", args.min_requests),
                              ("confirm_s", args.confirm_s), ("max_ttft_p99_ratio", args.max_ttft_p99_ratio),
                              ("max_error_rate_increase", args.max_error_rate_increase)) if v is not None}
    answer = admin.call("POST", f"/admin/models/{model}/canary/start", body)
    policy = answer["policy"]
    steps = " -> ".join(f"{step['weight']:g}%" for step in policy["ramp"])
    print(f"canary started: {policy['canary']} ramps {steps} against {policy['baseline']}; the rollback "
          f"controller checks the shadow's gates on the live arms at every step")
    print("next: `duet migrate status` to follow the ramp (promoted at 100%, or rolled back)")
    return 0


def status(admin: Admin, args) -> int:
    model, workers = _model(admin, args.model)
    _print_deployment(model, workers, admin.call("GET", f"/admin/models/{model}/routing"))
    shadow_answer = admin.call("GET", f"/admin/models/{model}/shadow")
    _print_shadow(shadow_answer)
    policy = admin.call("GET", f"/admin/models/{model}/canary-policy")
    _print_canary(policy)
    report = shadow_answer["shadow"]
    if policy.get("promoted"):
        print("next: the candidate serves everything; retire the old pool (and `DELETE .../shadow`)")
    elif policy["policy"] is not None and not policy["rolled_back"]:
        print("next: wait: the ramp goes on while the canary stays within its bounds")
    elif report is None:
        print("next: `duet migrate shadow --candidate KIND@VERSION`")
    elif report["verdict"]["passed"]:
        print("next: `duet migrate canary`")
    else:
        print("next: more traffic, or a better candidate: the gates have not passed")
    return 0


STEPS = {"plan": plan, "shadow": shadow, "canary": canary, "status": status}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="move a model to another engine pool: plan, shadow, gated canary, status")
    steps = p.add_subparsers(dest="migrate_step", required=True)
    for name, help_text in (("plan", "what runs now, and what to try"),
                            ("shadow", "mirror a share of live traffic to a candidate pool (answers dropped)"),
                            ("canary", "start the canary of the shadow's candidate, if its gates pass"),
                            ("status", "the shadow's figures beside the primary's, the gates and the canary")):
        s = steps.add_parser(name, help=help_text, description=help_text)
        s.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's base URL")
        s.add_argument("--admin-key", default=os.environ.get("DUET_ADMIN_KEY"), help="or DUET_ADMIN_KEY")
        s.add_argument("--model", default=None, help="the model (default: the one served)")
        if name == "plan":
            s.add_argument("--no-advise", dest="advise", action="store_false",
                           help="only the deployment: skip `duet bench advise` on the gateway's capture")
            s.add_argument("--cost-model", default=None, choices=("h200", "h200-70b", "cpu"),
                           help="advise's cost model (default: calibrated from the backends' measured rates where "
                           "vLLM or SGLang served the capture, loadtests/advise/calibrated.py; else h200)")
            s.add_argument("--workers", type=int, default=None,
                           help="advise's fleet size (default: the model's workers, at least 2)")
            s.add_argument("--window-s", type=float, default=300.0, help="capture seconds advise replays")
        if name == "shadow":
            s.add_argument("--candidate", type=_pool, action="append", required=True, metavar="KIND@VERSION",
                           help="a candidate pool (repeatable), e.g. paged@v2 or an external backend's "
                                "paged@external")
            s.add_argument("--share", type=float, default=0.1, help="share of live requests mirrored")
            s.add_argument("--max-concurrency", type=int, default=4, help="copies in flight at most")
            s.add_argument("--window-s", type=float, default=120.0, help="the figures' window")
            s.add_argument("--max-loop-lag-ms", type=float, default=10.0,
                           help="no copy starts while the gateway's event loop runs this late (short of CPU)")
            s.add_argument("--gates", type=json.loads, default=None,
                           help='JSON, e.g. \'{"max_ttft_p50_ratio": 1.5, "min_greedy_agreement": 0.9}\'')
        if name == "canary":
            s.add_argument("--ramp", type=_ramp, default=None, metavar="W:HOLD_S,...",
                           help="the canary's share (percent) and hold per step; default 10:60,50:120,100:120")
            s.add_argument("--window-s", type=float, default=None, help="the rollback's window (default: the shadow's)")
            s.add_argument("--min-requests", type=int, default=None, help="canary requests before a verdict")
            s.add_argument("--confirm-s", type=float, default=None, help="a breach must last this long")
            s.add_argument("--max-ttft-p99-ratio", type=float, default=None,
                           help="the rollback's own TTFT p99 bound, canary over baseline (default 2.0)")
            s.add_argument("--max-error-rate-increase", type=float, default=None,
                           help="the rollback's own error-rate bound (default 0.05)")
        s.set_defaults(func=run, step=name)


def run(args) -> int:
    try:
        return STEPS[args.step](Admin(args.gateway, args.admin_key), args)
    except MigrateError as e:
        print(f"duet migrate {args.step}: {e}", file=sys.stderr)
        return 1
