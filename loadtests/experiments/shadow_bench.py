"""Does shadow traffic cost the primary anything? `python -m loadtests.experiments.shadow_bench [--quick] --json`

Two `duet engine sim` workers posing as engine_paged (20 ms per token), `v1` the primary and `v2` the candidate
(a variant of weight 0), behind one `duet gateway` process. The same closed-loop load (16 streams of greedy,
streaming chat completions) runs with the shadow off, then on (every request offered to the mirror, cap 16
copies, the default event-loop lag bound unless --max-loop-lag-ms says otherwise), alternating which goes first
for several rounds so that the drift of a shared machine falls on both alike. Reported per mode: the client's
TTFT p50/p99 (time to the first SSE event), each round's p50 (the noise), errors, and the gateway process's CPU
time per request (user + system, from /proc); with the shadow on, the copies made and dropped by reason.

Sim workers are light, so what differs between the modes is mostly the gateway's work for the copies (decide,
send, read the candidate's stream, compare); the candidate sim runs on the same cores here, which a real
candidate on its own hardware would not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from duet.launcher import Launcher, SimOptions, WorkerSpec, free_port, gateway_config
from loadtests.experiments.gateway_bench import HttpConn, _pct, _wait_port, print_result

ADMIN_KEY = "shadow-bench"
CONCURRENCY = 16
MAX_TOKENS = 16
SIM_MS_PER_TOKEN = 20


async def load(port: int, model: str, per_stream: int, tag: str) -> tuple[list[float], int]:
    """CONCURRENCY keep-alive streams of `per_stream` greedy requests each: (TTFTs, errors)."""
    ttfts: list[float] = []
    errors = 0

    async def one_stream(k: int) -> None:
        nonlocal errors
        conn = HttpConn(port)
        await asyncio.sleep(k / CONCURRENCY * MAX_TOKENS * SIM_MS_PER_TOKEN / 1000)  # no lockstep
        try:
            for i in range(per_stream):
                body = json.dumps({"model": model, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
                                   "messages": [{"role": "user", "content": f"{tag} stream {k} request {i}"}]})
                ttft, ok = await conn.stream(body.encode())
                if ok and ttft is not None:
                    ttfts.append(ttft)
                else:
                    errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(one_stream(k) for k in range(CONCURRENCY)))
    return ttfts, errors


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(quick: bool, rounds: int, max_loop_lag_ms: float) -> dict:
    from duet.model_make import default_model_dir

    model_dir = default_model_dir()
    model = model_dir.name
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="duet-shadowbench-")))
    ports = {"v1": free_port(), "v2": free_port()}
    gw_port = free_port()
    for version, port in ports.items():
        launcher.start_worker(f"sim-{version}", WorkerSpec("sim", model_dir, port, worker_id=f"paged-{version}",
                                                           version=version, sim=SimOptions(
                                                               as_kind="paged", ms_per_token=SIM_MS_PER_TOKEN)))
    routing = {"variants": [
        {"name": "primary", "weight": 100, "pools": [{"engine_kind": "paged", "version": "v1"}]},
        {"name": "candidate", "weight": 0, "pools": [{"engine_kind": "paged", "version": "v2"}]}]}
    gw_pid = launcher.start_gateway("gw", gateway_config(model_dir, [f"127.0.0.1:{p}" for p in ports.values()], port=gw_port,
                                                poll_interval_s=1.0, routing=routing, auth={"admin_key": ADMIN_KEY}))
    admin = httpx.Client(base_url=f"http://127.0.0.1:{gw_port}", timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    try:
        for port in (*ports.values(), gw_port):
            await _wait_port(launcher, port)
        await asyncio.sleep(2.0)  # the first health polls
        await load(gw_port, model, 1, "warm-up")
        per_stream = 3 if quick else 10
        modes: dict[str, dict] = {m: {"ttfts": [], "errors": 0, "cpu_s": 0.0, "round_p50s": []} for m in ("off", "on")}
        copies = 0
        dropped: dict[str, int] = {}
        shadow = {"pools": [{"engine_kind": "paged", "version": "v2"}], "share": 1.0,
                  "max_concurrency": CONCURRENCY, "window_s": 300, "max_loop_lag_ms": max_loop_lag_ms}
        for r in range(rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                if mode == "on":
                    admin.put(f"/admin/models/{model}/shadow", json=shadow).raise_for_status()
                cpu0 = cpu_s(gw_pid)
                ttfts, errors = await load(gw_port, model, per_stream, f"round {r} {mode}")
                if mode == "on":  # the copies still in flight are the shadow's cost too
                    deadline = time.monotonic() + 30
                    while admin.get(f"/admin/models/{model}/shadow").json()["shadow"]["in_flight"] \
                            and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                modes[mode]["cpu_s"] += cpu_s(gw_pid) - cpu0
                modes[mode]["ttfts"] += ttfts
                modes[mode]["round_p50s"].append(round(_pct(ttfts, 0.5) * 1000, 3))
                modes[mode]["errors"] += errors
                if mode == "on":
                    report = admin.get(f"/admin/models/{model}/shadow").json()["shadow"]
                    copies += report["shadow"]["requests"]
                    for reason, n in report["dropped"].items():
                        dropped[reason] = dropped.get(reason, 0) + n
                    admin.delete(f"/admin/models/{model}/shadow").raise_for_status()
        result: dict = {"quick": quick, "rounds": rounds, "max_loop_lag_ms": max_loop_lag_ms,
                        "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS,
                        "sim_ms_per_token": SIM_MS_PER_TOKEN, "cpu_count": os.cpu_count()}
        for mode, m in modes.items():
            result[f"ttft_p50_ms_shadow_{mode}"] = round(_pct(m["ttfts"], 0.5) * 1000, 3)
            result[f"ttft_p99_ms_shadow_{mode}"] = round(_pct(m["ttfts"], 0.99) * 1000, 3)
            result[f"requests_shadow_{mode}"] = len(m["ttfts"]) + m["errors"]
            result[f"errors_shadow_{mode}"] = m["errors"]
            result[f"round_ttft_p50s_ms_shadow_{mode}"] = m["round_p50s"]  # the noise: p50 round by round
            result[f"gateway_cpu_ms_per_request_shadow_{mode}"] = round(
                m["cpu_s"] * 1000 / max(1, len(m["ttfts"]) + m["errors"]), 3)
        result["shadow_copies"] = copies
        result["shadow_dropped"] = dropped
        return result
    finally:
        admin.close()
        launcher.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.experiments.shadow_bench")
    ap.add_argument("--quick", action="store_true", help="fewer requests per stream")
    ap.add_argument("--rounds", type=int, default=4, help="off/on pairs, alternating which goes first")
    ap.add_argument("--max-loop-lag-ms", type=float, default=10.0,
                    help="the shadow's event-loop lag bound (its default); large: copies are never dropped for lag")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args.quick, args.rounds, args.max_loop_lag_ms))
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
