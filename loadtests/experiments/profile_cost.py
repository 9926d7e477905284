"""What the workload profile and the traffic capture cost the gateway per request:
`python -m loadtests.experiments.profile_cost [--rounds 3] [--json]`.

`duet gateway` processes over the same two sim workers (20 ms a token, as the gateway bench), one per variant
(`--variants`, default `off,on`): `off` the profile and the capture off, `on` both on (capture at sample rate 1:
every request), `profile` the profile alone, `capture` the capture alone, `off2` a second `off` and `on2` a second
`on` (A/As: what two identical processes differ by, the harness's own noise). Each round sends the gateway bench's burst
(loadtests/experiments/gateway_bench.py: 1,000 concurrent streaming chats of 16 tokens) to each gateway in turn,
the order rotating from round to round, and reads the gateway process's CPU seconds (user + system,
/proc/PID/stat) around it: CPU ms per request per variant, and each variant's overhead over `off` as a share (of
the medians, and the median of the per-round ratios). Rotating the order spreads a neighbour's load on a shared
machine over every variant alike; the per-round figures are in the output. `--scrape-s S` scrapes each gateway's
/metrics every S seconds during its burst (as Prometheus would; 0, the default: never).

`finished_us` is the in-process time of the one call a finished request makes (`Workload.finished`) for a
chat of the burst's shape and for a 1,100-token prompt sharing a 1,000-token system prompt; `flush_us` the
capture's flush of those requests (their hashing and serializing, gateway/control/capture.py) per request.
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
from pathlib import Path

from duet.launcher import Launcher, SimOptions, WorkerSpec, free_port, gateway_config
from loadtests.experiments.gateway_bench import SIM_MS_PER_TOKEN, _wait_port, print_result, streams_burst

STREAMS, MAX_TOKENS = 1000, 16
CAPTURE_ON = {"enabled": True, "max_records": 100_000}
VARIANTS = {  # name -> the gateway config's extra sections
    "off": {"profile": {"enabled": False}},
    "on": {"capture": CAPTURE_ON},
    "profile": {},
    "capture": {"profile": {"enabled": False}, "capture": CAPTURE_ON},
    "off2": {"profile": {"enabled": False}},
    "on2": {"capture": CAPTURE_ON},
}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _scrape(port: int, every_s: float) -> None:
    """GET /metrics every `every_s` seconds until cancelled (a raw request: the client stays light)."""
    while True:
        await asyncio.sleep(every_s)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        await r.read()
        w.close()


async def _burst_cpu_ms(pid: int, port: int, model: str, scrape_s: float = 0.0) -> tuple[float, int]:
    before = cpu_seconds(pid)
    scraper = asyncio.create_task(_scrape(port, scrape_s)) if scrape_s > 0 else None
    try:
        errors, _ = await streams_burst(port, model, STREAMS, MAX_TOKENS)
    finally:
        if scraper is not None:
            scraper.cancel()
    return (cpu_seconds(pid) - before) * 1000 / STREAMS, errors


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


async def run(rounds: int, variants: tuple[str, ...] = ("off", "on"), scrape_s: float = 0.0) -> dict:
    from duet.model_make import default_model_dir

    model_dir = default_model_dir()
    model = model_dir.name
    load_before = os.getloadavg()
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="duet-profilecost-")))
    sim_ports = [free_port(), free_port()]
    try:
        for i, p in enumerate(sim_ports):
            launcher.start_worker(f"sim{i}", WorkerSpec("sim", model_dir, p, sim=SimOptions(
                as_kind="prefix", ms_per_token=SIM_MS_PER_TOKEN)))
        for p in sim_ports:
            await _wait_port(launcher, p)
        workers = [f"127.0.0.1:{p}" for p in sim_ports]
        gateways = {}
        for name in variants:
            extra = VARIANTS[name]
            port = free_port()
            pid = launcher.start_gateway(f"gw-{name}", gateway_config(model_dir, workers, port=port,
                                                                     poll_interval_s=1.0, **extra))
            gateways[name] = (pid, port)
        for _, port in gateways.values():
            await _wait_port(launcher, port)
        await asyncio.sleep(2.0)  # the first health polls
        for pid, port in gateways.values():  # warm-up: imports, connections, first compiles
            await streams_burst(port, model, 50, MAX_TOKENS)
        per_round: list[dict] = []
        for r in range(rounds):
            row = {}
            k = r % len(variants)  # rotate the order: each variant goes first as often as the others
            for name in variants[k:] + variants[:k]:
                pid, port = gateways[name]
                ms, row[f"{name}_errors"] = await _burst_cpu_ms(pid, port, model, scrape_s)
                row[f"{name}_cpu_ms_per_request"] = round(ms, 4)
            per_round.append(row)
            print(f"round {r + 1}: {row}", file=sys.stderr, flush=True)
        out = {"streams": STREAMS, "max_tokens": MAX_TOKENS, "variants": list(variants), "scrape_s": scrape_s,
               "rounds": per_round, "cpu_count": os.cpu_count(),
               "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
        med = {name: statistics.median(r[f"{name}_cpu_ms_per_request"] for r in per_round) for name in variants}
        for name in variants:
            out[f"{name}_cpu_ms_per_request"] = round(med[name], 4)
        if "off" in variants:
            for name in variants:
                if name == "off":
                    continue
                out[f"{name}_overhead_share"] = round((med[name] - med["off"]) / med["off"], 4)
                ratios = [r[f"{name}_cpu_ms_per_request"] / r["off_cpu_ms_per_request"] for r in per_round]
                out[f"{name}_round_ratio_median"] = round(statistics.median(ratios), 4)
            if "on" in variants:
                out["overhead_share"] = out["on_overhead_share"]  # the figure the earlier runs printed
        return out
    finally:
        launcher.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.experiments.profile_cost")
    ap.add_argument("--rounds", type=int, default=3, help="bursts per gateway, alternating (default 3)")
    ap.add_argument("--variants", default="off,on",
                    help=f"gateways to compare, comma-separated, from {', '.join(VARIANTS)} (default off,on)")
    ap.add_argument("--scrape-s", type=float, default=0.0, help="scrape /metrics this often during a burst (0: never)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(set(variants)) != len(variants) or not variants:
        ap.error(f"--variants: names from {', '.join(VARIANTS)}, each once (got {args.variants!r})")
    result = asyncio.run(run(args.rounds, variants, args.scrape_s))
    result["finished_us"], result["flush_us"] = finished_us()
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
