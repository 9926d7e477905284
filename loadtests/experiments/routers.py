"""`duet bench routers`: Duet's gateway against the routers a team would install instead, each in turn in front of
the SAME engine servers, replaying a trace at a set rate (issue 45).

    engines    `duet`: N `duet engine paged` workers, each behind a one-worker Duet gateway that serves it over
               OpenAI's HTTP API (the quick option: the tiny model runs it in `make test`). Duet's workers have
               no cache-reset call, so each router replays the trace with its own token mapping (`salted`: the
               same prompt lengths and shared-prefix structure, other token ids): no router finds the blocks
               an earlier one left (the KV budget holds a replay without eviction by default).
               `vllm`: N real vLLM servers from the peer virtualenv (loadtests/stack/vllm_server.py), each bound
               to one core, prefix caching and KV events on; their prefix caches reset between routers
               (POST /reset_prefix_cache, vLLM's dev-mode endpoint).
    routers    `duet` (Duet's gateway with the servers as `backends`: KV events for vLLM), and the peers from
               PyPI (loadtests/stack/peer_routers.py): sglang-router and smg cache_aware, vllm-router
               round_robin, cache_aware and kv_aware. A peer not installed is installed first (pip, seconds);
               one that fails to install or start is reported as skipped, with the reason.
    load       a trace (the shipped ones by default: loadtests/traces/shipped.py) as text prompts (its token
               ids decoded by the model's tokenizer: routers that hash text see text), Poisson arrivals at
               `--rate`, the same requests for every router.

Per router: the engines' own hit rate (prefix-cache hit tokens over query tokens, from their counters), TTFT
and e2e p50/p90/p99, goodput (requests a second within the class SLO the gateway would give each request:
duet/traffic_classes.py, cpu profile), per-server balance (the most loaded server's requests over the mean),
errors, requests the engines saw against requests sent (retry amplification), and the router's CPU seconds per
request (its process tree's user + system time over the replay). `--repeats K` runs every router K times and
reports medians; `--find-rate` doubles or halves the rate from `--rate` until the best peer keeps 90% of requests
within SLO at one rate and not at another, then tries rates between them (four replays in all), and compares every
router at the highest rate where the best peer kept 90% (every rate tried is in the JSON's `tried`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from duet.traffic_classes import CPU, bound_of, classify

ENGINES = ("duet", "vllm")
GOOD_SHARE = 0.9  # --find-rate: the share of requests within SLO the best peer must keep
DEFAULT_TRACES = ("mooncake", "azure_conv", "azure_code")


# -- what one replay measured -----------------------------------------------------------------------------------
def within_slo(r) -> bool:
    """A loadtests.load.client.RequestRecord within the class SLO the gateway's rule gives it (cpu profile)."""
    if not r.ok:
        return False
    cls = classify(False, r.session_id is not None, r.prompt_tokens)
    return bound_of(cls, CPU).met_by(r.ttft_s, r.tpot_s, r.prompt_tokens)


def _pct(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def figures(records, before: list[dict], after: list[dict], cpu_s: float) -> dict:
    """One replay's report row: `before`/`after` are each server's counters (`EngineFleet.counters`)."""
    ok = [r for r in records if r.ok]
    duration = max((r.end_s for r in records), default=0.0) - min((r.start_s for r in records), default=0.0)
    seen = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    good = sum(1 for r in records if within_slo(r))
    mean_seen = sum(seen) / len(seen) if seen else 0.0
    return {
        "sent": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "hit_rate": hits / queries if queries else None,
        "ttft_s": _pct([r.ttft_s for r in ok]),
        "e2e_s": _pct([r.e2e_s for r in ok]),
        "within_slo": good / len(records) if records else 0.0,
        "goodput_rps": good / duration if duration > 0 else 0.0,
        "per_server": seen,
        "balance": max(seen) / mean_seen if mean_seen else None,
        "engines_saw": sum(seen),
        "amplification": sum(seen) / len(records) if records else None,
        "router_cpu_s_per_request": cpu_s / len(records) if records else None,
        "error_kinds": sorted({r.error for r in records if r.error})[:5],
    }


def median_row(rows: list[dict]) -> dict:
    """The median of each figure over repeats (nested p50/p90/p99 too); lists and texts from the first."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: _median([r[key][k] for r in rows]) for k in value}
        elif isinstance(value, (int, float)) or value is None:
            out[key] = _median([r[key] for r in rows])
    out["repeats"] = len(rows)
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# -- engine servers -----------------------------------------------------------------------------------------------
def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _metric_sum(text: str, name: str, where: str = "") -> float:
    """The sum of a Prometheus metric's samples whose labels contain `where`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ ") and where in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class DuetServer:
    """One `duet engine paged` worker and the one-worker Duet gateway that serves it over HTTP."""

    worker: subprocess.Popen
    front: subprocess.Popen
    address: str  # the worker's gRPC address
    url: str

    def counters(self) -> dict:
        import grpc

        from duet.rpc import engine_pb2 as pb
        from duet.rpc import engine_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.address) as ch:
            load = pb_grpc.EngineStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5.0)
        requests = _metric_sum(_get(self.url + "/metrics"), "duet_gateway_requests_total", 'endpoint="/v1/completions"')
        return {"queries": load.prefix_cache_queries_tokens, "hits": load.prefix_cache_hits_tokens,
                "requests": requests}

    def stop(self) -> None:
        for p in (self.front, self.worker):
            if p.poll() is None:
                p.terminate()
        for p in (self.front, self.worker):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


class DuetFleet:
    """N Duet workers with their HTTP fronts; `reset()` restarts them (cold caches)."""

    block_size = None  # Duet's gateway reads it from the workers
    kv_sources = ()

    def __init__(self, model: Path, n: int, log_dir: Path, kv_cache_tokens: int) -> None:
        self.model, self.n, self.log_dir, self.kv_cache_tokens = model, n, log_dir, kv_cache_tokens
        self.servers: list[DuetServer] = []

    def start(self) -> None:
        from duet.launcher import EngineLimits, WorkerSpec, duet_argv, free_port, gateway_config, worker_argv

        for i in range(self.n):
            port = free_port()
            spec = WorkerSpec("paged", self.model, port, worker_id=f"server-{i}", device="cpu",
                              limits=EngineLimits(kv_cache_tokens=self.kv_cache_tokens))
            worker = _spawn(worker_argv(spec), self.log_dir / f"server-{i}-worker.log")
            front_port = free_port()
            cfg = self.log_dir / f"server-{i}-front.yaml"
            cfg.write_text(yaml.safe_dump(gateway_config(self.model, [f"127.0.0.1:{port}"], port=front_port,
                                                         poll_interval_s=0.5)))
            front = _spawn(duet_argv("gateway", "--config", str(cfg)), self.log_dir / f"server-{i}-front.log")
            self.servers.append(DuetServer(worker, front, f"127.0.0.1:{port}", f"http://127.0.0.1:{front_port}"))
        from duet.launcher import healthy_workers

        deadline = time.monotonic() + 900  # a first start compiles the CPU kernels (minutes on a busy machine)
        for s in self.servers:
            while healthy_workers(s.url) < 1:
                if time.monotonic() > deadline or s.worker.poll() is not None or s.front.poll() is not None:
                    raise RuntimeError(f"engine server {s.url} did not come up; logs in {self.log_dir}")
                time.sleep(0.5)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def backends(self) -> list[dict]:
        return [{"engine": "openai", "url": s.url, "kind": "paged"} for s in self.servers]

    def counters(self) -> list[dict]:
        return [s.counters() for s in self.servers]

    def reset(self) -> None:
        pass  # salted prompts instead (module doc)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers = []


class VllmFleet:
    """N vLLM servers, server i's model worker bound to core i (one core each), prefix caching and KV events on."""

    block_size = 32

    def __init__(self, model: Path, n: int, log_dir: Path, kv_cache_gib: int) -> None:
        self.model, self.n, self.log_dir, self.kv_cache_gib = model, n, log_dir, kv_cache_gib
        self.servers = []
        self.kv_ports: list[tuple[int, int]] = []

    def start(self) -> None:
        from duet.launcher import free_port
        from loadtests.stack import vllm_server

        venv = vllm_server.ensure_installed()
        cores = sorted(os.sched_getaffinity(0))
        for i in range(self.n):
            kv, replay = free_port(), free_port()
            d = self.log_dir / f"server-{i}"
            d.mkdir(parents=True, exist_ok=True)
            args = (*vllm_server.backend_args(kv, replay), "--block-size", str(self.block_size))
            server = vllm_server.VllmServer(
                venv, self.model, self.model.name, d, max_num_seqs=32, max_num_batched_tokens=2048,
                kv_cache_gib=self.kv_cache_gib, extra_args=args,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)]), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                     "VLLM_SERVER_DEV_MODE": "1"})
            server.__enter__()
            self.servers.append(server)
            self.kv_ports.append((kv, replay))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def kv_sources(self):
        from loadtests.stack.peer_routers import KvSource

        return tuple(KvSource(s.url, f"tcp://127.0.0.1:{kv}", f"tcp://127.0.0.1:{replay}")
                     for s, (kv, replay) in zip(self.servers, self.kv_ports))

    def backends(self) -> list[dict]:
        from loadtests.stack.peer_backends import backend_entry

        return [{**backend_entry(s, kv, replay), "block_size": self.block_size}
                for s, (kv, replay) in zip(self.servers, self.kv_ports)]

    def counters(self) -> list[dict]:
        out = []
        for s in self.servers:
            text = _get(s.url + "/metrics")
            out.append({"queries": _metric_sum(text, "vllm:prefix_cache_queries_total"),
                        "hits": _metric_sum(text, "vllm:prefix_cache_hits_total"),
                        # the peers POST /v1/completions, Duet's gateway vLLM's token-in endpoint
                        "requests": sum(_metric_sum(text, "http_requests_total", f'handler="{path}"')
                                        for path in ("/v1/completions", "/inference/v1/generate"))})
        return out

    def reset(self) -> None:
        for s in self.servers:
            req = urllib.request.Request(s.url + "/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(req, timeout=30):
                pass

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers = []


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))


# -- routers --------------------------------------------------------------------------------------------------------
def router_process(name: str, fleet, model: Path, log_dir: Path):
    """The RouterProcess of router `name` in front of `fleet`'s servers (not started)."""
    from duet.launcher import duet_argv, free_port
    from loadtests.stack import peer_routers

    peer, policy = peer_routers.parse_router(name)
    port = free_port()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    if peer is None:
        cfg = log_dir / "duet-gateway.yaml"
        # the deployment's defaults, as the peers', but for the class SLOs it serves under: the cpu profile the
        # report judges every router by (routing holds a worker's predicted latency to them)
        cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": port, "models": [{"path": str(model)}],
                                       "backends": fleet.backends(), "routing": {"slo_profile": "cpu"}}))
        return peer_routers.RouterProcess(name, duet_argv("gateway", "--config", str(cfg)), port,
                                          log_dir / f"{safe}.log")
    argv = peer_routers.peer_argv(peer, policy, port, fleet.urls, model=model.name, block_size=fleet.block_size,
                                  kv_sources=fleet.kv_sources)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return peer_routers.RouterProcess(name, argv, port, log_dir / f"{safe}.log", env=env)


def _wait_routed(url: str, model: str, timeout_s: float = 120.0) -> None:
    """Until the router answers a one-token completion (its workers found healthy)."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(1.0)
    raise RuntimeError(f"the router at {url} served no completion in {timeout_s:.0f} s ({last})")


# -- the contest ----------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    engines: str
    servers: int
    routers: tuple[str, ...]
    trace: str
    requests: int
    rate: float
    repeats: int
    max_prompt_tokens: int
    max_tokens: int
    model: Path
    log_dir: Path
    kv_cache_tokens: int = 32768
    kv_cache_gib: int = 2


def build_requests(plan: Plan):
    """The trace's requests and the token ids a prompt may hold (what `salted` permutes)."""
    from loadtests.load import trace_workloads
    from loadtests.load.workloads import TokenSource
    from loadtests.traces import shipped
    from loadtests.traces.formats import detect_format

    src = TokenSource.from_model_dir(plan.model)
    allowed = [int(i) for i in src.allowed]
    path = shipped.resolve(plan.trace)
    fmt = detect_format(path)
    if fmt == "mooncake":
        return trace_workloads.mooncake(path, src, plan.requests, plan.max_prompt_tokens, plan.max_tokens), allowed
    if fmt == "azure":
        return trace_workloads.azure(path, Path(path).stem, src, plan.requests, plan.max_prompt_tokens,
                                     plan.max_tokens), allowed
    raise ValueError(f"{path}: `duet bench routers` replays mooncake or azure traces, not {fmt}")


def salted(requests, allowed: list[int], salt: int):
    """The requests with every token id mapped through a permutation of the `allowed` ids seeded by `salt` (0: as
    they are): the same lengths and shared prefixes, none of another salt's blocks."""
    import random
    from dataclasses import replace

    if salt == 0:
        return requests
    shuffled = list(allowed)
    random.Random(salt).shuffle(shuffled)
    to = dict(zip(allowed, shuffled))
    return [replace(r, prompt_token_ids=tuple(to[t] for t in r.prompt_token_ids)) for r in requests]


def replay(plan: Plan, progress=print, rate: float | None = None) -> dict:
    """{router: row} for every router in `plan` (skipped ones: {"skipped": reason})."""
    from duet.tokenizer import Tokenizer
    from loadtests.load.client import run_benchmark
    from loadtests.stack import peer_routers

    requests, allowed = build_requests(plan)
    tok = Tokenizer.from_dir(plan.model)
    rate = rate or plan.rate
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    fleet = (DuetFleet(plan.model, plan.servers, plan.log_dir, plan.kv_cache_tokens) if plan.engines == "duet"
             else VllmFleet(plan.model, plan.servers, plan.log_dir, plan.kv_cache_gib))
    results: dict[str, dict] = {}
    rows: dict[str, list[dict]] = {}
    try:
        fleet.start()
        for repeat in range(plan.repeats):
            for i, name in enumerate(plan.routers):
                if "skipped" in results.get(name, {}):
                    continue
                peer, _policy = peer_routers.parse_router(name)
                try:
                    if peer is not None:
                        peer_routers.ensure_installed(peer, progress)
                except Exception as e:  # noqa: BLE001 - a peer that will not install is reported, not fatal
                    results[name] = {"skipped": f"install failed: {e}"}
                    continue
                fleet.reset()
                router = router_process(name, fleet, plan.model, plan.log_dir)
                try:
                    with router:
                        _wait_routed(router.url, plan.model.name)
                        progress(f"{name}: {len(requests)} requests at {rate:g}/s over {plan.servers} servers")
                        before, cpu0 = fleet.counters(), router.cpu_seconds()
                        salt = 0 if isinstance(fleet, VllmFleet) else 1 + repeat * len(plan.routers) + i
                        records = run_benchmark(router.url, plan.model.name, salted(requests, allowed, salt),
                                                rate=rate, decode=tok.decode, timeout_s=300.0, progress=False)
                        time.sleep(1.0)  # the engines' counters settle (an aborted stream's last step)
                        cpu = router.cpu_seconds() - cpu0
                        rows.setdefault(name, []).append(figures(records, before, fleet.counters(), cpu))
                except Exception as e:  # noqa: BLE001 - a router that will not start is reported, not fatal
                    results[name] = {"skipped": f"did not run: {e}".splitlines()[0][:300]}
    finally:
        fleet.stop()
    for name, rs in rows.items():
        if name not in results:
            results[name] = median_row(rs)
    return {name: results[name] for name in plan.routers if name in results}


def best_share(table: dict) -> float:
    """The largest share of requests within SLO among the peers that ran (Duet's where none did)."""
    peers = [row for name, row in table.items() if name != "duet" and "skipped" not in row]
    return max((row["within_slo"] for row in peers or table.values() if "within_slo" in row), default=0.0)


def find_rate(plan: Plan, progress=print, steps: int = 4, replay_at=None) -> tuple[float, dict, dict]:
    """The highest rate tried where the best peer (else Duet) keeps GOOD_SHARE within SLO, its table, and every
    rate tried's table. From `plan.rate` it doubles or halves until one rate holds and one does not, then tries the
    geometric mean of the highest that held and the lowest that did not: `steps` replays, none at a rate tried
    (doubling alone stepped back onto a rate it had run and never looked between two). `replay_at(rate)` -> table
    (default: `replay` of the plan at that rate)."""
    replay_at = replay_at or (lambda rate: replay(plan, progress, rate))
    tried: dict[float, dict] = {}
    held = failed = None  # the highest rate whose best peer kept GOOD_SHARE, the lowest whose best did not
    rate = plan.rate
    for _ in range(steps):
        tried[rate] = replay_at(rate)
        if best_share(tried[rate]) >= GOOD_SHARE:
            held = rate if held is None else max(held, rate)
        else:
            failed = rate if failed is None else min(failed, rate)
        if held is None:
            rate = failed / 2
        elif failed is None:
            rate = held * 2
        else:
            rate = float(f"{math.sqrt(held * failed):.3g}")  # the bracket's geometric mean, to three digits
        if rate in tried:
            break  # held and failed are as close as the rates' three digits go
    best = held if held is not None else min(tried)
    return best, tried[best], tried


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def format_table(table: dict, rate: float) -> str:
    lines = [f"rate {rate:g} requests/s", "",
             ("| router | hit rate | TTFT p50/p90/p99 (s) | e2e p50/p90/p99 (s) | within SLO | goodput (req/s) | "
              "balance (max/mean) | errors | engines saw / sent | router CPU ms/request |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} |||||||||")
            continue
        t, e = row["ttft_s"], row["e2e_s"]
        hit = "—" if row["hit_rate"] is None else f"{row['hit_rate']:.1%}"
        cpu = row["router_cpu_s_per_request"]
        lines.append(
            f"| {name} | {hit} | {_s(t['p50'])} / {_s(t['p90'])} / {_s(t['p99'])} | {_s(e['p50'])} / {_s(e['p90'])} / "
            f"{_s(e['p99'])} | {row['within_slo']:.0%} | {row['goodput_rps']:.2f} | {_s(row['balance'])} | "
            f"{row['errors']:g} | {row['engines_saw']:g} / {row['sent']:g} | {'—' if cpu is None else f'{cpu * 1000:.1f}'} |")
    return "\n".join(lines) + "\n"


# -- the command ----------------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    from loadtests.stack.peer_routers import ROUTERS

    p = sub.add_parser("routers", help="Duet's gateway against installable peer routers, in front of the same "
                       "engine servers, replaying a trace (issue 45)")
    p.add_argument("--engines", choices=ENGINES, default="duet",
                   help="duet: Duet workers behind one-worker gateways (quick); vllm: real vLLM from the peer venv")
    p.add_argument("--servers", type=int, default=2, help="engine servers (default 2)")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, from: {', '.join(ROUTERS)}")
    p.add_argument("--trace", action="append", default=None,
                   help="a shipped trace name or a file (repeatable; default: every shipped trace)")
    p.add_argument("--requests", type=int, default=200, help="requests replayed from each trace (default 200)")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs per router; the report gives medians")
    p.add_argument("--find-rate", action="store_true",
                   help="search the rate where the best peer keeps 90%% of requests within SLO (from --rate)")
    p.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log-dir", default="bench-routers", help="engine and router logs (default ./bench-routers)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=main)


def plans(args: argparse.Namespace) -> list[Plan]:
    from duet.model_make import default_model_dir
    from loadtests.stack.peer_routers import parse_router

    routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    for r in routers:
        parse_router(r)
    if args.servers < 1 or args.requests < 1 or args.rate <= 0 or args.repeats < 1:
        raise ValueError("--servers, --requests, --repeats must be >= 1 and --rate > 0")
    model = Path(args.model) if args.model else default_model_dir()
    out = []
    for trace in args.trace or DEFAULT_TRACES:
        out.append(Plan(args.engines, args.servers, routers, trace, args.requests, args.rate, args.repeats,
                        args.max_prompt_tokens, args.max_tokens, model,
                        Path(args.log_dir) / re.sub(r"[^A-Za-z0-9_.-]", "_", Path(trace).stem)))
    return out


def main(args: argparse.Namespace) -> int:
    results = {}
    for plan in plans(args):
        tried = {}
        if args.find_rate:
            rate, table, tried = find_rate(plan)
        else:
            rate, table = plan.rate, replay(plan)
        print(f"\n## {plan.trace} ({plan.engines} engines x {plan.servers}, {plan.requests} requests)\n")
        for r in sorted(tried):
            print(f"rate {r:g}/s: the best peer kept {best_share(tried[r]):.0%} within SLO")
        print(format_table(table, rate))
        results[plan.trace] = {"rate": rate, "routers": table}
        if tried:
            results[plan.trace]["tried"] = {f"{r:g}": tried[r] for r in sorted(tried)}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
