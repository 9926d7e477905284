"""`duet bench baseline save FILE` / `check FILE`: the upgrade gate, a performance baseline per engine kind.

A fixed load (`LOAD`) runs on one worker of each kind behind one gateway, whose routing config sends it to one
kind at a time: closed loop, requests that share a system prompt (so the prefix cache has something to hit)
plus a distinct question each, greedy with ignore_eos (exact lengths). It is repeated `repeats` times in one
sitting; each figure (output tok/s, TTFT and TPOT p50/p99, prefix-cache hit rate, errors) is kept as the
median of the repeats AND their spread: the noise this machine shows right now. Timings and throughput vary by factors (a neighbour's burst slows a run by half, not
by a fixed number of milliseconds), so their spread is the standard deviation of the repeats' logarithms;
the hit rate and the error count are compared as plain numbers. `save` writes medians and spreads with the
Duet version, the model and the machine; `check` runs the same loads again and fails a figure that is worse
than the saved median by more than `NOISE_FACTOR` times the larger of the two sittings' spreads (a quiet
machine gets a tight band, a busy one a wide band; never tighter than x1.15, `MIN_LOG_BAND`) in each of up to `SITTINGS`
sittings: a figure outside its band is measured again, since on a shared machine the load of the neighbours
changes between sittings more than within one, while a slower build is slower every time. A baseline from
another model or load is refused; one from another machine is compared with a warning (its figures mean
little here).

`compare` is pure (two baselines in, rows out), so the band logic is tested without a stack.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

from duet.contract import ENGINE_KINDS as KINDS

FORMAT = 1
NOISE_FACTOR = 3.0  # a regression must exceed three standard deviations of the run-to-run noise
# the narrowest band of a timing or rate, a factor of 1.15: seven steady repeats can measure a spread far below
# what the same machine drifts between sittings minutes apart (an unchanged checkout once failed its band in
# three sittings running, during a full test run on a 2-core VM); the slowdowns the gate exists for are well past it
MIN_LOG_BAND = math.log(1.15)
SITTINGS = 3  # a figure outside its band is measured again, up to this many sittings in all


@dataclass(frozen=True)
class Load:
    num_requests: int = 8
    concurrency: int = 4
    shared_prompt_tokens: int = 96  # the system prompt every request starts with
    own_prompt_tokens: int = 32
    max_tokens: int = 16


LOAD = Load()
# figure -> (higher is better, compared on a log scale)
FIGURES = {"output_tok_s": (True, True), "ttft_p50_s": (False, True), "ttft_p99_s": (False, True),
           "tpot_p50_s": (False, True), "tpot_p99_s": (False, True), "hit_rate": (True, False),
           "errors": (False, False)}
_TINY = 1e-9  # log of a zero figure (every request failed): very bad, still a number


def _scaled(figure: str, value: float) -> float:
    return math.log(max(value, _TINY)) if FIGURES[figure][1] else value


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def figures_of(records, wall_s: float) -> dict[str, float]:
    """One run's figures from its loadtests.client.RequestRecords."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {"output_tok_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
            "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99),
            "tpot_p50_s": _quantile(tpot, 0.5), "tpot_p99_s": _quantile(tpot, 0.99),
            "hit_rate": sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else 0.0,
            "errors": float(len(records) - len(ok))}


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """figure -> {median, spread, runs} over the repeats of one sitting (spread: the standard deviation,
    of the logarithms for the log-scale figures)."""
    out = {}
    for f in FIGURES:
        values = [r[f] for r in runs]
        scaled = [_scaled(f, v) for v in values]
        out[f] = {"median": statistics.median(values), "spread": statistics.pstdev(scaled), "runs": values}
    return out


def requests_for(tokens, load: Load, tag: str):
    """The load's requests: the shared system prompt, then a question of their own (drawn under `tag`)."""
    from loadtests.load.workloads import BenchRequest

    shared = tokens.draw("baseline-system", load.shared_prompt_tokens)
    return [BenchRequest(f"{tag}-{i}", "baseline", tuple(shared + tokens.draw(f"baseline-{tag}-{i}",
                                                                               load.own_prompt_tokens)),
                         load.max_tokens) for i in range(load.num_requests)]


def only(kind: str) -> dict:
    """A routing config that sends every request to `kind` (one variant, that kind's pool)."""
    return {"variants": [{"name": kind, "weight": 1, "pools": [{"engine_kind": kind}]}]}


def measure_kind(stack, tokens, kind: str, repeats: int, load: Load = LOAD, progress=None) -> dict:
    """Route the stack's traffic to `kind`, warm it, run the load `repeats` times; the summary.

    Every repeat meets the same cache state: the warm-up has cached the shared prompt, and each repeat
    asks questions of its own (the same ones in every sitting), so its hit rate is the shared prompt's."""
    import time

    import httpx

    from loadtests.load.client import run_benchmark
    from loadtests.stack.serving import ADMIN_KEY

    name = stack.model.name
    r = httpx.put(f"{stack.url}/admin/models/{name}/routing", json=only(kind), timeout=30,
                  headers={"authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    warm = requests_for(tokens, Load(num_requests=2, max_tokens=load.max_tokens), "warm")
    run_benchmark(stack.url, name, warm, concurrency=2, progress=False)  # not measured
    runs = []
    for i in range(repeats):
        start = time.perf_counter()
        records = run_benchmark(stack.url, name, requests_for(tokens, load, f"r{i}"), concurrency=load.concurrency,
                                progress=False)
        runs.append(figures_of(records, time.perf_counter() - start))
        if any(rec.engine != kind for rec in records if rec.ok):
            raise RuntimeError(f"the gateway served some of the {kind} load on another kind")
        if progress:
            progress(f"{kind} run {i + 1}/{repeats}: {runs[-1]['output_tok_s']:.1f} tok/s, "
                     f"TTFT p50 {runs[-1]['ttft_p50_s'] * 1000:.0f} ms")
    return summarize(runs)


def environment(model: str | Path) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        duet_version = version("duet")
    except PackageNotFoundError:
        duet_version = "unknown"
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip() or None
    config = Path(model) / "config.json"
    return {"duet_version": duet_version, "commit": commit, "model": Path(model).name,
            "model_config": json.loads(config.read_text()) if config.is_file() else None,
            "machine": {"node": platform.node(), "arch": platform.machine(), "cpus": os.cpu_count(),
                        "processor": platform.processor(), "python": platform.python_version()}}


def measure(model: str | Path, repeats: int = 7, kinds=KINDS, progress=None, log_dir: Path | None = None) -> dict:
    if repeats < 2:
        raise ValueError("--repeats must be at least 2: the noise band is measured from the repeats")
    from loadtests.load.workloads import TokenSource
    from loadtests.stack.serving import EngineLimits, ServingStack

    tokens = TokenSource.from_model_dir(model)
    # one worker of each kind, started together; the kinds are measured one after the other (the idle
    # worker waits on its inbox and costs no CPU)
    limits = EngineLimits(kv_cache_tokens=16384, max_num_seqs=LOAD.concurrency)
    with ServingStack(model, list(kinds), only(kinds[0]), limits=limits, log_dir=log_dir) as stack:
        figures = {k: measure_kind(stack, tokens, k, repeats, progress=progress) for k in kinds}
    return {"format": FORMAT, **environment(model), "load": LOAD.__dict__, "repeats": repeats, "kinds": figures}


def compare(saved: dict, now: dict, factor: float = NOISE_FACTOR, min_band: float = MIN_LOG_BAND) -> list[dict]:
    """One row per kind and figure: both medians, the band, and whether `now` regressed beyond it. For the
    log-scale figures the band is a factor (`band` is its logarithm), never narrower than `min_band`."""
    rows = []
    for kind, figures in saved["kinds"].items():
        if kind not in now["kinds"]:
            continue
        for figure, (higher_is_better, log_scale) in FIGURES.items():
            a, b = figures[figure], now["kinds"][kind][figure]
            band = factor * max(a["spread"], b["spread"])
            if log_scale:
                band = max(band, min_band)
            change = _scaled(figure, b["median"]) - _scaled(figure, a["median"])
            worse_by = -change if higher_is_better else change
            rows.append({"kind": kind, "figure": figure, "saved": a["median"], "now": b["median"],
                         "band": band, "log_scale": log_scale, "regressed": worse_by > band})
    return rows


def comparable(saved: dict, now: dict) -> list[str]:
    """Why the two cannot be compared (empty: they can)."""
    problems = []
    if saved.get("format") != FORMAT:
        problems.append(f"baseline format {saved.get('format')}, this Duet writes {FORMAT}")
    for key in ("model", "model_config", "load"):
        if saved.get(key) != now.get(key):
            problems.append(f"the baseline's {key} differs from this run's")
    return problems


def format_rows(rows: list[dict]) -> str:
    lines = ["| kind | figure | saved | now | noise band | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "REGRESSED" if r["regressed"] else "ok"
        band = f"x{math.exp(r['band']):.2f}" if r["log_scale"] else f"+-{r['band']:.3g}"
        lines.append(f"| {r['kind']} | {r['figure']} | {r['saved']:.4g} | {r['now']:.4g} | {band} | {verdict} |")
    return "\n".join(lines)


def save(path: str | Path, model: str | Path, repeats: int, progress=None) -> dict:
    result = measure(model, repeats, progress=progress)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def check(path: str | Path, model: str | Path, sittings: int = SITTINGS, min_band: float = MIN_LOG_BAND,
          progress=None) -> tuple[int, str]:
    """(exit status, report): 0 all within the band, 1 a regression, 2 not comparable. `min_band` is the
    narrowest band of a timing or rate (a logarithm).

    A figure outside its band is measured again in a new sitting (up to `sittings` in all) and fails only
    if it is outside in every one: a neighbour's burst on a shared machine passes, a slower build does not."""
    saved = json.loads(Path(path).read_text())
    now = {"format": FORMAT, **environment(model), "load": LOAD.__dict__}
    if problems := comparable(saved, now):
        return 2, "cannot compare: " + "; ".join(problems)
    suspects: set[tuple[str, str]] | None = None
    for sitting in range(1, sittings + 1):
        now = measure(model, saved["repeats"], kinds=tuple(saved["kinds"]), progress=progress)
        rows = compare(saved, now, min_band=min_band)
        outside = {(r["kind"], r["figure"]) for r in rows if r["regressed"]}
        suspects = outside if suspects is None else suspects & outside
        for r in rows:
            r["regressed"] = (r["kind"], r["figure"]) in suspects
        if not suspects:
            break
        if progress and sitting < sittings:
            progress(f"outside the band: {', '.join(f'{k} {f}' for k, f in sorted(suspects))}; measuring again")
    notes = []
    if saved["machine"] != now["machine"]:
        notes.append("warning: the baseline was measured on another machine; its figures mean little here")
    notes.append(f"baseline {saved.get('commit') or saved['duet_version']}, now {now.get('commit') or now['duet_version']}"
                 f"; {sitting} sitting(s)")
    notes.append(f"{len(suspects)} figure(s) regressed beyond {NOISE_FACTOR:g} standard deviations of the run-to-run "
                 f"noise in all {sitting} sittings" if suspects else "no figure regressed beyond the noise band")
    return (1 if suspects else 0), format_rows(rows) + "\n\n" + "\n".join(notes)


def add_parser(sub) -> None:
    """`duet bench baseline save|check FILE` (argparse only; the run imports lazily)."""
    p = sub.add_parser(
        "baseline", help="the upgrade gate: save a performance baseline per engine kind, check a build against it",
        description="Runs a fixed load on a one-worker stack of each engine kind, repeated in one sitting, and "
        "records output tok/s, TTFT and TPOT p50/p99, prefix-cache hit rate and errors with the run-to-run "
        "spread, the Duet version, the model and the machine (save); check runs it again and exits 1 with a "
        f"table when a figure is worse than the saved one by more than {NOISE_FACTOR:g} standard deviations of "
        "the run-to-run noise "
        "(docs/operations.md, 'The upgrade gate').")
    actions = p.add_subparsers(dest="baseline_command", required=True)
    for name, doc in (("save", "measure and write the baseline"), ("check", "measure again and compare")):
        a = actions.add_parser(name, help=doc)
        a.add_argument("file", help="the baseline JSON")
        a.add_argument("--model", default=None, help="model directory (default: the tiny random model)")
        if name == "save":
            a.add_argument("--repeats", type=int, default=7, help="runs of the load per kind (the noise band)")
        else:
            a.add_argument("--sittings", type=int, default=SITTINGS,
                           help="a figure outside its band is measured again, up to this many sittings in all")
            a.add_argument("--min-band", type=float, default=math.exp(MIN_LOG_BAND), metavar="FACTOR",
                           help="the narrowest band of a timing or tok/s, as a factor (default %(default).2f); "
                           "raise it on a machine whose load drifts between sittings")
        a.set_defaults(func=_run)


def _run(args) -> int:
    import sys

    from duet.model_make import default_model_dir
    from loadtests.stack.serving import StackError

    model = Path(args.model) if args.model else default_model_dir()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.baseline_command == "save":
            result = save(args.file, model, args.repeats, progress=progress)
            for kind, figures in result["kinds"].items():
                print(f"{kind}: " + ", ".join(f"{f} {v['median']:.4g} (spread {v['spread']:.2g})"
                                              for f, v in figures.items()))
            print(f"wrote {args.file}")
            return 0
        if args.sittings < 1:
            raise ValueError("--sittings must be at least 1")
        if args.min_band <= 1:
            raise ValueError("--min-band must be a factor above 1 (1.15: 15%)")
        status, report = check(args.file, model, args.sittings, math.log(args.min_band), progress=progress)
    except StackError as e:
        print(f"duet bench baseline: {e}", file=sys.stderr)
        return 2
    print(report)
    return status
