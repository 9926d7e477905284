"""What the workload profile and the traffic capture cost the gateway per request:
`python -m loadtests.experiments.profile_cost [--rounds 3] [--json]`.

Two `duet gateway` processes over the same two sim workers (20 ms a token, as the gateway bench): one with the
profile and the capture off, one with both on (capture at sample rate 1: every request). Each round sends the
gateway bench's burst (loadtests/experiments/gateway_bench.py: 1,000 concurrent streaming chats of 16 tokens)
to each gateway in turn, the order alternating, and reads the gateway process's CPU seconds (user + system,
/proc/PID/stat) around it: CPU ms per request, with and without, and the overhead as a share. Rounds alternate
so a neighbour's load on a shared machine falls on both alike; the per-round figures are in the output.

`finished_us` is the in-process time of the one call a finished request makes (`Workload.finished`) for a
chat of the burst's shape and for a 1,100-token prompt sharing a 1,000-token system prompt.
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


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _burst_cpu_ms(pid: int, port: int, model: str) -> tuple[float, int]:
    before = cpu_seconds(pid)
    errors, _ = await streams_burst(port, model, STREAMS, MAX_TOKENS)
    return (cpu_seconds(pid) - before) * 1000 / STREAMS, errors


def finished_us(samples: int = 2000) -> dict:
    """Microseconds per Workload.finished call (profile + capture on), median of `samples`."""
    from duet.hashing import block_hashes
    from gateway.control.capture import CaptureConfig
    from gateway.control.state.memory import MemoryStore
    from gateway.control.workload import Workload

    rng = random.Random(0)
    system = [rng.randrange(1000, 30000) for _ in range(1000)]
    out = {}
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
    return out


async def run(rounds: int) -> dict:
    from duet.model_make import default_model_dir

    model_dir = default_model_dir()
    model = model_dir.name
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
        for name, extra in (("off", {"profile": {"enabled": False}}),
                            ("on", {"capture": {"enabled": True, "max_records": 100_000}})):
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
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                pid, port = gateways[name]
                row[f"{name}_cpu_ms_per_request"], row[f"{name}_errors"] = await _burst_cpu_ms(pid, port, model)
                row[f"{name}_cpu_ms_per_request"] = round(row[f"{name}_cpu_ms_per_request"], 4)
            per_round.append(row)
            print(f"round {r + 1}: {row}", file=sys.stderr, flush=True)
        off = statistics.median(r["off_cpu_ms_per_request"] for r in per_round)
        on = statistics.median(r["on_cpu_ms_per_request"] for r in per_round)
        return {"streams": STREAMS, "max_tokens": MAX_TOKENS, "rounds": per_round,
                "off_cpu_ms_per_request": round(off, 4), "on_cpu_ms_per_request": round(on, 4),
                "overhead_share": round((on - off) / off, 4), "cpu_count": os.cpu_count()}
    finally:
        launcher.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.experiments.profile_cost")
    ap.add_argument("--rounds", type=int, default=3, help="bursts per gateway, alternating (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args.rounds))
    result["finished_us"] = finished_us()
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
