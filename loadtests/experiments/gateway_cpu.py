"""The gateway's CPU per request in front of fake vLLM servers (issue 45's "CPU per request <= 3x the lightest
peer's", without the engines): `python -m loadtests.experiments.gateway_cpu [--json FILE]`.

`--servers` fake vLLM 0.32 servers (loadtests/stack/fake_vllm.py: token ids streamed `--token-ms` apart, a
real vLLM 0.32 /metrics page of ~58 KB) behind one `duet gateway` process configured as `duet bench routers`
configures it (`vllm` backends, block 32, the cpu SLO profile; no KV events: the fakes publish none). Phases, each
the gateway process tree's user + system CPU seconds (psutil) over the phase:

    idle        `--idle-s` seconds with no requests: the background polls' CPU per second
    rate        `--requests` (60) of the Mooncake trace's first records (as `duet bench routers` sends them: text
                prompts, `--max-prompt-tokens`) at `--rate` requests/s, Poisson: CPU per request at a low steady
                rate, polls included (what `duet bench routers` reports)
    full        `--full-requests` (240) of them closed-loop at `--concurrency`: CPU per request at full speed,
                polls a small share

`--max-tokens 16,64` runs the rate and full phases once per output length (each request then streams exactly that
many tokens: the fakes answer max_tokens); `--rounds N` repeats it all, each round with a fresh gateway, and
reports each figure's rounds and median. `--checkouts A,B` runs each round's gateway from each checkout in turn
(its PYTHONPATH; the order alternates between rounds, AB then BA), against the same fakes and the same client, so
a before/after comparison is a ratio within each round (`ratios`: each checkout over the first, per round).

psutil reads CPU time in clock ticks (10 ms), hence the phases' sizes. CPU seconds are process time, so a loaded
machine moves them less than it moves latencies; still, say the load (the report carries the load average at the
start and end of each gateway's phases).
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


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def _gateway_phases(gw, model: Path, tok, idle_s: float, rate: float, concurrency: int, batches: dict,
                    progress) -> dict:
    """One gateway's phases (module doc): {"idle_cpu_ms_per_s": ..., "rate@16": {...}, "full@16": {...}, ...}."""
    from loadtests.experiments.routers import _wait_routed
    from loadtests.load.client import run_benchmark

    out: dict = {"load_average_start": os.getloadavg()}
    _wait_routed(gw.url, model.name)
    time.sleep(2.0)  # the first polls and the warm-up request settle
    c0 = gw.cpu_seconds()
    time.sleep(idle_s)
    out["idle_cpu_ms_per_s"] = (gw.cpu_seconds() - c0) / idle_s * 1000
    progress(f"  idle: {out['idle_cpu_ms_per_s']:.2f} ms CPU/s")
    for n, (reqs, full_reqs) in batches.items():
        for phase, batch, kwargs in (("rate", reqs, {"rate": rate}), ("full", full_reqs, {"concurrency": concurrency})):
            c0, t0 = gw.cpu_seconds(), time.monotonic()
            records = run_benchmark(gw.url, model.name, batch, decode=tok.decode, timeout_s=120.0, progress=False,
                                    **kwargs)
            cpu, wall = gw.cpu_seconds() - c0, time.monotonic() - t0
            errors = sum(1 for r in records if not r.ok)
            key = f"{phase}@{n}"
            out[key] = {"cpu_ms_per_request": cpu / len(records) * 1000, "wall_s": wall,
                        "requests_per_s": len(records) / wall, "errors": errors,
                        "output_tokens": sum(r.output_tokens for r in records),
                        "max_tokens": sum(r.max_tokens for r in batch)}  # each fake answers max_tokens
            progress(f"  {key}: {out[key]['cpu_ms_per_request']:.2f} ms CPU/request, "
                     f"{out[key]['requests_per_s']:.2f} req/s, {errors} errors")
    out["load_average_end"] = os.getloadavg()
    return out


def measure(model: Path, servers: int, requests: int, full_requests: int, rate: float, concurrency: int, idle_s: float,
            token_ms: float, max_prompt_tokens: int, max_tokens: int | list[int], log_dir: Path,
            gateway_extra: dict | None = None, progress=print, rounds: int = 1,
            checkouts: list[str] | None = None) -> dict:
    """The figures of the module doc. One checkout and one output length (the defaults): the flat report
    (`idle_cpu_ms_per_s`, `rate`, `full`) of the first round, plus `rounds`/`medians` (as with several)."""
    from dataclasses import replace

    from duet.launcher import duet_argv, free_port
    from duet.tokenizer import Tokenizer
    from loadtests.experiments.routers import Plan, build_requests
    from loadtests.stack.peer_routers import RouterProcess

    lengths = [max_tokens] if isinstance(max_tokens, int) else list(max_tokens)
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
        batches = {}
        for n in lengths:
            plan = Plan("vllm", servers, ("duet",), "mooncake", requests, rate, 1, max_prompt_tokens, n, model,
                        log_dir)
            reqs, _ = build_requests(plan)
            plan.requests = full_requests
            full_reqs, _ = build_requests(plan)
            if len(lengths) > 1:  # exactly n tokens each: the trace's own output lengths would mix in shorter ones
                reqs, full_reqs = ([replace(r, max_tokens=n) for r in b] for b in (reqs, full_reqs))
            batches[n] = (reqs, full_reqs)
        tok = Tokenizer.from_dir(model)
        names = checkouts or [""]
        out: dict = {"servers": servers, "token_ms": token_ms, "requests": requests, "full_requests": full_requests,
                     "rate": rate, "concurrency": concurrency, "max_tokens": max_tokens, "idle_s": idle_s,
                     "checkouts": names, "rounds": []}
        for r in range(rounds):
            row = {}
            for name in (names if r % 2 == 0 else names[::-1]):
                port = free_port()
                cfg = log_dir / f"gateway-{r}-{names.index(name)}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "host": "127.0.0.1", "port": port, "models": [{"path": str(model)}],
                    "backends": [{"engine": "vllm", "url": u, "kind": "paged", "block_size": 32} for u in urls],
                    "routing": {"slo_profile": "cpu"}, **(gateway_extra or {})}))
                env = None
                if name:  # that checkout's gateway (the harness and the fakes stay this one's); PYTHONSAFEPATH:
                    # `python -m` would otherwise put the working directory, this checkout, first on the path
                    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join(
                        [str(Path(name).resolve()), *filter(None, [os.environ.get("PYTHONPATH", "")])]))
                progress(f"round {r + 1}/{rounds}, checkout {name or '(this one)'}")
                gw = RouterProcess("duet", duet_argv("gateway", "--config", str(cfg)), port,
                                   log_dir / f"gateway-{r}-{names.index(name)}.log", env=env)
                with gw:
                    row[name] = _gateway_phases(gw, model, tok, idle_s, rate, concurrency, batches, progress)
            out["rounds"].append(row)
        keys = ["idle_cpu_ms_per_s"] + [f"{p}@{n}" for n in lengths for p in ("rate", "full")]

        def figure(row: dict, key: str) -> float:
            return row[key] if key == "idle_cpu_ms_per_s" else row[key]["cpu_ms_per_request"]

        out["medians"] = {name: {k: _median([figure(rd[name], k) for rd in out["rounds"]]) for k in keys}
                          for name in names}
        if len(names) > 1:
            out["ratios"] = {name: {k: [figure(rd[name], k) / figure(rd[names[0]], k) if figure(rd[names[0]], k)
                                        else None for rd in out["rounds"]] for k in keys} for name in names[1:]}
        if len(names) == 1 and len(lengths) == 1:  # the flat report of one gateway, as before
            first = out["rounds"][0][names[0]]
            out.update({"idle_cpu_ms_per_s": first["idle_cpu_ms_per_s"], "rate": first[f"rate@{lengths[0]}"],
                        "full": first[f"full@{lengths[0]}"], "load_average_start": first["load_average_start"],
                        "load_average_end": first["load_average_end"]})
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
    p.add_argument("--max-tokens", default="16", help="output tokens a request; several, comma-separated: each "
                   "request exactly that many, the rate and full phases once per length")
    p.add_argument("--rounds", type=int, default=1, help="each figure this many times (a fresh gateway each), medians")
    p.add_argument("--checkouts", default=None, help="comma-separated checkout directories whose gateways run in "
                   "turn each round (PYTHONPATH), before/after as ratios within a round")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else default_model_dir()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="gateway-cpu-"))
    lengths = [int(x) for x in args.max_tokens.split(",")]
    out = measure(model, args.servers, args.requests, args.full_requests, args.rate, args.concurrency, args.idle_s,
                  args.token_ms, args.max_prompt_tokens, lengths[0] if len(lengths) == 1 else lengths, log_dir,
                  rounds=args.rounds, checkouts=args.checkouts.split(",") if args.checkouts else None)
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
