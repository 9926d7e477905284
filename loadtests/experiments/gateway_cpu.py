"""The gateway's CPU per request in front of fake vLLM servers (issue 45's "CPU per request <= 3x the lightest
peer's", without the engines): `python -m loadtests.experiments.gateway_cpu [--json FILE]`.

`--servers` fake vLLM 0.32 servers (loadtests/stack/fake_vllm.py: token ids streamed `--token-ms` apart, a
~55 KB vLLM-shaped /metrics page) behind one `duet gateway` process configured as `duet bench routers` configures
it (`vllm` backends, block 32, the cpu SLO profile; no KV events: the fakes publish none). Three phases, each the
gateway process tree's user + system CPU seconds (psutil) over the phase:

    idle        `--idle-s` seconds with no requests: the background polls' CPU per second
    rate        `--requests` (60) of the Mooncake trace's first records (as `duet bench routers` sends them: text
                prompts, `--max-prompt-tokens`, `--max-tokens`) at `--rate` requests/s, Poisson: CPU per request
                at a low steady rate, polls included (what `duet bench routers` reports)
    full        `--full-requests` (240) of them closed-loop at `--concurrency`: CPU per request at full speed,
                polls a small share

psutil reads CPU time in clock ticks (10 ms), hence the phases' sizes. CPU seconds are process time, so a loaded machine moves them less than it moves latencies; still, say the load
(the report carries the load average at the start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s; log {log}")


def measure(model: Path, servers: int, requests: int, full_requests: int, rate: float, concurrency: int, idle_s: float,
            token_ms: float, max_prompt_tokens: int, max_tokens: int, log_dir: Path, gateway_extra: dict | None = None,
            progress=print) -> dict:
    from duet.launcher import duet_argv, free_port
    from duet.tokenizer import Tokenizer
    from loadtests.experiments.routers import Plan, _wait_routed, build_requests
    from loadtests.load.client import run_benchmark
    from loadtests.stack.peer_routers import RouterProcess

    log_dir.mkdir(parents=True, exist_ok=True)
    fakes, urls = [], []
    try:
        for i in range(servers):
            port = free_port()
            log = log_dir / f"fake-vllm-{i}.log"
            fakes.append(_spawn([sys.executable, "-m", "loadtests.stack.fake_vllm", "--model", str(model),
                                 "--port", str(port), "--token-ms", str(token_ms)], log))
            urls.append(f"http://127.0.0.1:{port}")
            _wait_http(urls[-1] + "/health", 60, fakes[-1], log)
        port = free_port()
        cfg = log_dir / "gateway.yaml"
        cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": port, "models": [{"path": str(model)}],
                                       "backends": [{"engine": "vllm", "url": u, "kind": "paged", "block_size": 32}
                                                    for u in urls],
                                       "routing": {"slo_profile": "cpu"}, **(gateway_extra or {})}))
        plan = Plan("vllm", servers, ("duet",), "mooncake", requests, rate, 1, max_prompt_tokens, max_tokens, model,
                    log_dir)
        reqs, _ = build_requests(plan)
        plan.requests = full_requests
        full_reqs, _ = build_requests(plan)
        tok = Tokenizer.from_dir(model)
        gw = RouterProcess("duet", duet_argv("gateway", "--config", str(cfg)), port, log_dir / "gateway.log")
        out = {"load_average_start": os.getloadavg(), "servers": servers, "token_ms": token_ms,
               "requests": requests, "full_requests": full_requests, "rate": rate, "concurrency": concurrency, "max_tokens": max_tokens}
        with gw:
            _wait_routed(gw.url, model.name)
            time.sleep(2.0)  # the first polls and the warm-up request settle
            c0 = gw.cpu_seconds()
            time.sleep(idle_s)
            out["idle_cpu_ms_per_s"] = (gw.cpu_seconds() - c0) / idle_s * 1000
            progress(f"idle: {out['idle_cpu_ms_per_s']:.2f} ms CPU/s")
            for phase, batch, kwargs in (("rate", reqs, {"rate": rate}),
                                         ("full", full_reqs, {"concurrency": concurrency})):
                c0, t0 = gw.cpu_seconds(), time.monotonic()
                records = run_benchmark(gw.url, model.name, batch, decode=tok.decode, timeout_s=120.0, progress=False,
                                        **kwargs)
                cpu, wall = gw.cpu_seconds() - c0, time.monotonic() - t0
                errors = sum(1 for r in records if not r.ok)
                out[phase] = {"cpu_ms_per_request": cpu / len(records) * 1000, "wall_s": wall,
                              "requests_per_s": len(records) / wall, "errors": errors,
                              "output_tokens": sum(r.output_tokens for r in records),
                              "max_tokens": sum(r.max_tokens for r in batch)}  # each fake answers max_tokens
                progress(f"{phase}: {out[phase]['cpu_ms_per_request']:.2f} ms CPU/request, "
                         f"{out[phase]['requests_per_s']:.2f} req/s, {errors} errors")
        out["load_average_end"] = os.getloadavg()
        return out
    finally:
        for p in fakes:
            p.terminate()
        for p in fakes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> int:
    from duet.model_make import default_model_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=1.0, help="the `rate` phase's Poisson arrivals, requests/s")
    p.add_argument("--full-requests", type=int, default=240, help="the `full` phase's requests")
    p.add_argument("--concurrency", type=int, default=4, help="the `full` phase's requests in flight")
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--token-ms", type=float, default=10.0)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else default_model_dir()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="gateway-cpu-"))
    out = measure(model, args.servers, args.requests, args.full_requests, args.rate, args.concurrency, args.idle_s, args.token_ms,
                  args.max_prompt_tokens, args.max_tokens, log_dir)
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
