"""What the workload profile and the traffic capture cost the gateway per request:
`python -m loadtests.experiments.profile_cost [--rounds 3] [--variants off,on] [--json]`.

`duet gateway` processes over the same two sim workers (20 ms a token, as the gateway bench), one per variant
(`--variants`, default `off,on`): `off` the profile and the capture off, `on` both on (capture at sample rate
1: every request), `profile` the profile alone, `capture` the capture alone, `off2` a second `off` and `on2` a
second `on` (A/As: what two identical processes differ by, the harness's own noise), `gc_off` an `off` with
Python's own cyclic GC instead of the gateway's policy (`gc: {freeze: false, gen0_threshold: null}`,
gateway/gc_policy.py). Each round sends the gateway bench's burst (loadtests/experiments/gateway_bench.py:
1,000 concurrent streaming chats of 16 tokens) to each variant's gateway in turn and reads the gateway
process's CPU seconds (user + system, /proc/PID/stat) around it: CPU ms per request per variant, and each
variant's overhead over `off` as a share (of the medians, and the per-round paired ratios' median, quartiles
and range), and each gateway's resident memory after its burst (`{name}_rss_mb`: with `--same-processes` and
many rounds, a soak of one process per variant) and its cyclic-GC collections so far (`{name}_gc_collections`,
generations 0-2, from its /metrics). `ab_vs_aa` sets each A/B's median overhead beside the A/As' (text output:
the first lines). `--scrape-s S` scrapes each gateway's /metrics every S seconds during its burst (as
Prometheus would; 0, the default: never). `--drop-after-s S`: each client drops its stream after S seconds,
so the gateway cancels it mid-stream (the cancelled path's garbage, for a soak; every dropped stream is counted
in `{name}_errors`); the burst then lasts until the gateway holds no request.

Every round starts fresh gateway processes for every variant (the round's order shuffled, `--seed`) and stops
them after it: a process's own luck (heap layout, hash seed, the core it lands on) then falls on one round of
its variant, and the paired ratios average it out over rounds. Two quiet runs with one process per variant for
all rounds (`--same-processes`, the order rotated) differed by 2 points between two identical `off` processes,
as much as `on` and `off` did (docs/benchmarks.md). Each round's gateways start and warm up before any of them is
measured, so one's start-up never lands in another's burst. A fresh `on` gateway's profile holds one burst: a cost
that grows with the profile's ring (as its rows' GC walk did before 2026-12-07) shows with `--same-processes` only.

`finished_us` is the in-process time of the one call a finished request makes (`Workload.finished`) for a
chat of the burst's shape and for a 1,100-token prompt sharing a 1,000-token system prompt; `flush_us` the
capture's flush of those requests per request (their lines pushed to the state store: the hashing and the
serializing are done in `finished`, gateway/control/capture.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from duet.launcher import Launcher, SimOptions, WorkerSpec, free_port, gateway_config
from loadtests.experiments.gateway_bench import SIM_MS_PER_TOKEN, _wait_port, print_result, streams_burst

STREAMS, MAX_TOKENS = 1000, 16
WARMUP_STREAMS = 50
CAPTURE_ON = {"enabled": True, "max_records": 100_000}
VARIANTS = {  # name -> the gateway config's extra sections
    "off": {"profile": {"enabled": False}},
    "on": {"capture": CAPTURE_ON},
    "profile": {},
    "capture": {"profile": {"enabled": False}, "capture": CAPTURE_ON},
    "off2": {"profile": {"enabled": False}},
    "on2": {"capture": CAPTURE_ON},
    "gc_off": {"profile": {"enabled": False}, "gc": {"freeze": False, "gen0_threshold": None}},
}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gc_collections(port: int) -> list[int]:
    """The gateway's cyclic-GC collections so far, by generation (its /metrics, gateway/gc_policy.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = [0, 0, 0]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "duet_gateway_gc_collections_total":
                out[int(s.labels["generation"])] = int(s.value)
    return out


async def _settled(port: int, timeout_s: float = 60.0) -> None:
    """Wait until the gateway holds no request (its duet_gateway_pending_requests 0), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        text = (await r.read()).decode()
        w.close()
        if "\nduet_gateway_pending_requests 0.0\n" in text:
            return
        await asyncio.sleep(0.1)


async def _scrape(port: int, every_s: float) -> None:
    """GET /metrics every `every_s` seconds until cancelled (a raw request: the client stays light)."""
    while True:
        await asyncio.sleep(every_s)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        await r.read()
        w.close()


async def _burst_cpu_ms(pid: int, port: int, model: str, scrape_s: float = 0.0,
                        streams: int = STREAMS, drop_after_s: float = 0.0) -> tuple[float, int]:
    before = cpu_seconds(pid)
    scraper = asyncio.create_task(_scrape(port, scrape_s)) if scrape_s > 0 else None
    try:
        errors, _ = await streams_burst(port, model, streams, MAX_TOKENS, timeout_s=drop_after_s or 300)
        if drop_after_s:
            await _settled(port)  # the dropped streams' cancellation is part of the burst's work
    finally:
        if scraper is not None:
            scraper.cancel()
    return (cpu_seconds(pid) - before) * 1000 / streams, errors


def finished_us(samples: int = 2000) -> tuple[dict, dict]:
    """Microseconds per Workload.finished call (profile + capture on), median of `samples`; and per request of
    the capture's flush of them."""
    from duet.hashing import block_hashes
    from gateway.control.capture import CaptureConfig
    from gateway.control.state.memory import MemoryStore
    from gateway.control.workload import Workload

    rng = random.Random(0)
    system = [rng.randrange(1000, 30000) for _ in range(1000)]
    out, flush = {}, {}
    for name, make in (("burst_chat", lambda: [rng.randrange(1000, 30000) for _ in range(30)]),
                       ("shared_1100_tokens", lambda: system + [rng.randrange(1000, 30000) for _ in range(100)])):
        w = Workload(CaptureConfig(enabled=True, max_records=samples), MemoryStore())
        asyncio.run(w.capture.flush())  # the salt
        times = []
        for i in range(samples):
            prompt = make()
            hashes = tuple(block_hashes(prompt, 16, "m", max_blocks=256))
            t0 = time.perf_counter()
            w.finished(model="m", session=None, turns=1, hashes=hashes, prompt_ids=prompt, tenant_salt="",
                       output_tokens=16, cached_tokens=0, traffic_class="oneshot", engine="prefix",
                       duration_s=0.4, ttft_s=0.05, tpot_s=0.02)
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times) * 1e6, 2)
        t0 = time.perf_counter()
        asyncio.run(w.capture.flush())
        flush[name] = round((time.perf_counter() - t0) * 1e6 / samples, 2)
    return out, flush


def _quartiles(values: list[float]) -> list[float]:
    """[q1, median, q3] (the `inclusive` method: within the values' range even for a few rounds)."""
    if len(values) == 1:
        return [values[0]] * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def summarize(per_round: list[dict], variants: tuple[str, ...]) -> dict:
    """The per-variant medians, and for each variant beside `off` the per-round paired ratios' median and spread:
    their quartiles, range and how many rounds were above 1 (`{name}_round_ratio_*`). `ab_vs_aa` puts each
    variant's median overhead beside the A/As' (`off2`: two `off` gateways; `on2` against `on`), the harness's
    own noise on the same rounds."""
    out: dict = {}
    med = {name: statistics.median(r[f"{name}_cpu_ms_per_request"] for r in per_round) for name in variants}
    for name in variants:
        out[f"{name}_cpu_ms_per_request"] = round(med[name], 4)
    if "off" not in variants:
        return out
    ab_vs_aa = {}
    for name in variants:
        if name == "off":
            continue
        out[f"{name}_overhead_share"] = round((med[name] - med["off"]) / med["off"], 4)
        ratios = [r[f"{name}_ratio_to_off"] for r in per_round]
        q1, q2, q3 = _quartiles(ratios)
        out[f"{name}_round_ratio_median"] = round(q2, 4)
        out[f"{name}_round_ratio_quartiles"] = [round(q1, 4), round(q3, 4)]
        out[f"{name}_round_ratio_range"] = [round(min(ratios), 4), round(max(ratios), 4)]
        out[f"{name}_rounds_above_1"] = sum(1 for x in ratios if x > 1)
        ab_vs_aa[name] = {"overhead_median": round(q2 - 1, 4), "iqr": round(q3 - q1, 4),
                          "range": round(max(ratios) - min(ratios), 4)}
    if "on" in variants:
        out["overhead_share"] = out["on_overhead_share"]  # the figure the earlier runs printed
    if "on2" in variants and "on" in variants:  # the A/A of two `on` gateways, paired within the round
        ratios = [r["on2_cpu_ms_per_request"] / r["on_cpu_ms_per_request"] for r in per_round]
        q1, q2, q3 = _quartiles(ratios)
        ab_vs_aa["on2/on"] = {"overhead_median": round(q2 - 1, 4), "iqr": round(q3 - q1, 4),
                              "range": round(max(ratios) - min(ratios), 4)}
    out["ab_vs_aa"] = ab_vs_aa
    return out


async def _start_gateways(launcher: Launcher, model_dir: Path, workers: list[str], variants: tuple[str, ...],
                          tag: str, model: str) -> dict[str, tuple[int, int]]:
    """One gateway per variant (names `gw-{variant}{tag}`), listening, through their first health polls and
    warmed up (imports, connections, first compiles): {variant: (pid, port)}."""
    gateways = {}
    for name in variants:
        port = free_port()
        pid = launcher.start_gateway(f"gw-{name}{tag}", gateway_config(model_dir, workers, port=port,
                                                                       poll_interval_s=1.0, **VARIANTS[name]))
        gateways[name] = (pid, port)
    for _, port in gateways.values():
        await _wait_port(launcher, port)
    await asyncio.sleep(2.0)  # the first health polls
    for _, port in gateways.values():
        await streams_burst(port, model, WARMUP_STREAMS, MAX_TOKENS)
    return gateways


async def run(rounds: int, variants: tuple[str, ...] = ("off", "on"), scrape_s: float = 0.0,
              fresh: bool = True, streams: int = STREAMS, seed: int = 0, drop_after_s: float = 0.0) -> dict:
    """`rounds` rounds of one burst per variant. `fresh` (the default): every round starts new gateway processes
    for every variant and stops them after it, so a process's own luck (heap layout, hash seed, core) falls
    on one round of a variant, not on all of them; the round's order is shuffled (seeded by `seed`). Not
    `fresh`: one gateway per variant for every round, the order rotating (the harness before 2026-12-07)."""
    from duet.model_make import default_model_dir

    model_dir = default_model_dir()
    model = model_dir.name
    load_before = os.getloadavg()
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="duet-profilecost-")))
    sim_ports = [free_port(), free_port()]
    rng = random.Random(seed)
    try:
        for i, p in enumerate(sim_ports):
            launcher.start_worker(f"sim{i}", WorkerSpec("sim", model_dir, p, sim=SimOptions(
                as_kind="prefix", ms_per_token=SIM_MS_PER_TOKEN)))
        for p in sim_ports:
            await _wait_port(launcher, p)
        workers = [f"127.0.0.1:{p}" for p in sim_ports]
        gateways = None if fresh else await _start_gateways(launcher, model_dir, workers, variants, "", model)
        per_round: list[dict] = []
        for r in range(rounds):
            if fresh:
                gateways = await _start_gateways(launcher, model_dir, workers, variants, f"-r{r + 1}", model)
                order = list(variants)
                rng.shuffle(order)
            else:
                k = r % len(variants)  # rotate the order: each variant goes first as often as the others
                order = list(variants[k:] + variants[:k])
            row: dict = {"order": order}
            for name in order:
                pid, port = gateways[name]
                ms, row[f"{name}_errors"] = await _burst_cpu_ms(pid, port, model, scrape_s, streams, drop_after_s)
                row[f"{name}_cpu_ms_per_request"] = round(ms, 4)
                row[f"{name}_pid"] = pid
                row[f"{name}_rss_mb"] = round(rss_mb(pid), 1)
                row[f"{name}_gc_collections"] = gc_collections(port)  # so far, generations 0, 1, 2
            if "off" in variants:
                for name in variants:
                    if name != "off":
                        row[f"{name}_ratio_to_off"] = round(row[f"{name}_cpu_ms_per_request"]
                                                            / row["off_cpu_ms_per_request"], 4)
            if fresh:
                for name in variants:
                    launcher.supervisor.stop(f"gw-{name}-r{r + 1}")
            per_round.append(row)
            print(f"round {r + 1}: {row}", file=sys.stderr, flush=True)
        out = {"streams": streams, "max_tokens": MAX_TOKENS, "variants": list(variants), "scrape_s": scrape_s,
               "drop_after_s": drop_after_s,
               "fresh_gateways_per_round": fresh, "seed": seed, "rounds": per_round, "cpu_count": os.cpu_count(),
               "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
        out.update(summarize(per_round, variants))
        return out
    finally:
        launcher.shutdown()


def print_text(result: dict) -> None:
    """The per-variant figures, each A/B beside the A/As (`ab_vs_aa`), then every other field."""
    for name in result["variants"]:
        line = f"{name:8s} {result[f'{name}_cpu_ms_per_request']:.4f} ms/request"
        if f"{name}_round_ratio_median" in result:
            q1, q3 = result[f"{name}_round_ratio_quartiles"]
            lo, hi = result[f"{name}_round_ratio_range"]
            line += (f"   per-round ratio to off: median {result[f'{name}_round_ratio_median']:.4f}, "
                     f"quartiles {q1:.4f}-{q3:.4f}, range {lo:.4f}-{hi:.4f}, "
                     f"{result[f'{name}_rounds_above_1']} of {len(result['rounds'])} rounds above 1")
        print(line)
    aa = {k: v for k, v in result.get("ab_vs_aa", {}).items() if k in ("off2", "on2/on")}
    for name, v in result.get("ab_vs_aa", {}).items():
        if name in aa:
            continue
        beside = "; ".join(f"A/A {k}: {a['overhead_median']:+.2%} (IQR {a['iqr']:.2%})" for k, a in aa.items())
        print(f"A/B {name}: {v['overhead_median']:+.2%} (IQR {v['iqr']:.2%})" + (f"   beside {beside}" if beside
                                                                                 else "   (no A/A: add off2)"))
    print_result({k: v for k, v in result.items() if k != "rounds"}, False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.experiments.profile_cost")
    ap.add_argument("--rounds", type=int, default=3, help="bursts per variant (default 3)")
    ap.add_argument("--variants", default="off,on",
                    help=f"gateways to compare, comma-separated, from {', '.join(VARIANTS)} (default off,on)")
    ap.add_argument("--scrape-s", type=float, default=0.0, help="scrape /metrics this often during a burst (0: never)")
    ap.add_argument("--same-processes", action="store_true",
                    help="one gateway per variant for every round, the order rotated (the harness before "
                         "2026-12-07); default: fresh gateways every round, the order shuffled")
    ap.add_argument("--seed", type=int, default=0, help="the shuffled orders' seed (default 0)")
    ap.add_argument("--drop-after-s", type=float, default=0.0,
                    help="each client drops its stream after this many seconds (the gateway cancels it; a "
                         "dropped stream counts as an error): the cancelled path's garbage in a soak; 0: never")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(set(variants)) != len(variants) or not variants:
        ap.error(f"--variants: names from {', '.join(VARIANTS)}, each once (got {args.variants!r})")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    result = asyncio.run(run(args.rounds, variants, args.scrape_s, fresh=not args.same_processes, seed=args.seed,
                             drop_after_s=args.drop_after_s))
    result["finished_us"], result["flush_us"] = finished_us()
    if args.json:
        print_result(result, True)
    else:
        print_text(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
