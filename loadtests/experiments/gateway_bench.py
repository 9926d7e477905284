"""Gateway overhead benchmark: `python -m loadtests.experiments.gateway_bench [--quick] --json`.

Measures, with `duet engine sim` workers pacing 20 ms per token and one `duet gateway` process:

- overhead_ttft_p50_ms / _p99_ms: TTFT through the gateway (time to the first SSE event of a
  streaming chat completion; the gateway sends its first event once the engine's first token is
  in) minus TTFT of a direct gRPC client (time to the first Generate message) to the same sim
  worker, each at 16 concurrent closed-loop streams; `_64` the same at 64 streams;
- streams_1000_errors / streams_1000_rps: 1,000 concurrent streams through the gateway to two
  sim workers (any non-200, error event or missing [DONE] counts as an error);
- route_decision_p99_ms: gateway.routing.policy.route for an 8,000-token prompt (its 256 head block
  hashes) over 8 workers with warm prefix tables, in-process; head_hash_p99_ms: hashing that head
  (duet.hashing.block_hashes, done once per request before routing).

The load generator is one asyncio loop with raw HTTP/1.1 sockets (no client library) so it stays
light next to the gateway on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

from duet.launcher import Launcher, SimOptions, WorkerSpec, free_port, gateway_config, listening
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc

SIM_MS_PER_TOKEN = 20


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _wait_port(launcher: Launcher, port: int, timeout_s: float = 60.0) -> None:
    await asyncio.to_thread(launcher.wait_until, lambda: listening(port), timeout_s, f"nothing listens on {port}",
                            interval_s=0.1)


def _stagger(k: int, concurrency: int, max_tokens: int) -> float:
    """Start offset of closed-loop stream k: spread over one request's duration, so the streams do not
    march in lockstep (identical requests started together would all arrive in the same millisecond,
    forever), for the direct client and the gateway alike."""
    return k / concurrency * max_tokens * SIM_MS_PER_TOKEN / 1000


# -- direct gRPC client ---------------------------------------------------------------------------
async def direct_ttfts(address: str, prompt_ids: list[int], concurrency: int, per_stream: int,
                       max_tokens: int) -> list[float]:
    out: list[float] = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.EngineStub(ch)

        async def one_stream(k: int) -> None:
            await asyncio.sleep(_stagger(k, concurrency, max_tokens))
            for i in range(per_stream):
                req = pb.GenerateRequest(request_id=f"d{k}-{i}", prompt_token_ids=prompt_ids,
                                         sampling=pb.SamplingParams(max_tokens=max_tokens, seed=k * 1000 + i))
                t0 = time.perf_counter()
                first = True
                async for _ in stub.Generate(req):
                    if first:
                        out.append(time.perf_counter() - t0)
                        first = False

        await asyncio.gather(*(one_stream(k) for k in range(concurrency)))
    return out


# -- raw HTTP client ------------------------------------------------------------------------------
class HttpConn:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol for SSE responses."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.r = self.w = None

    async def stream(self, body: bytes) -> tuple[float | None, bool]:
        """One streaming chat request: (seconds to the first SSE event, ok)."""
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
        t0 = time.perf_counter()
        self.w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        r = self.r
        ok = b" 200 " in await r.readline()
        length, chunked = None, False
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            if k.lower() == "content-length":
                length = int(v)
            elif k.lower() == "transfer-encoding" and "chunked" in v:
                chunked = True
        if not chunked:
            await r.readexactly(length or 0)
            return None, False
        ttft, tail = None, b""
        while True:
            size = int((await r.readline()).split(b";")[0], 16)
            data = await r.readexactly(size + 2)
            if size == 0:
                break
            if ttft is None and b"data:" in data:
                ttft = time.perf_counter() - t0
            if b'"error"' in data:
                ok = False
            tail = (tail + data)[-64:]
        return ttft, ok and b"data: [DONE]" in tail

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


async def http_stream(port: int, body: bytes) -> tuple[float | None, bool]:
    conn = HttpConn(port)
    try:
        return await conn.stream(body)
    finally:
        conn.close()


async def gateway_ttfts(port: int, model: str, prompt: str, concurrency: int, per_stream: int,
                        max_tokens: int) -> tuple[list[float], int]:
    out: list[float] = []
    errors = 0

    async def one_stream(k: int) -> None:
        nonlocal errors
        conn = HttpConn(port)  # keep-alive, as SDK clients do
        await asyncio.sleep(_stagger(k, concurrency, max_tokens))
        try:
            for i in range(per_stream):
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": max_tokens, "stream": True, "seed": k * 1000 + i}).encode()
                ttft, ok = await conn.stream(body)
                if ok and ttft is not None:
                    out.append(ttft)
                else:
                    errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(one_stream(k) for k in range(concurrency)))
    return out, errors


async def streams_burst(port: int, model: str, n: int, max_tokens: int,
                        timeout_s: float = 300) -> tuple[int, float]:
    """`n` concurrent streamed chats: (errors, requests/s). A stream not done in `timeout_s` is dropped (the
    connection closed, as a client that gives up; the gateway cancels it) and counts as an error."""
    sem_free = asyncio.Semaphore(n)

    async def one(k: int) -> bool:
        async with sem_free:
            body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"stream {k}"}],
                               "max_tokens": max_tokens, "stream": True}).encode()
            try:
                _, ok = await asyncio.wait_for(http_stream(port, body), timeout_s)
                return ok
            except (TimeoutError, OSError):
                return False

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(k) for k in range(n)))
    elapsed = time.perf_counter() - t0
    return sum(1 for ok in results if not ok), n / elapsed


# -- routing decision -----------------------------------------------------------------------------
def route_decision_ms(samples: int) -> tuple[float, float]:
    """(p99 ms of hashing an 8,000-token prompt's head, p99 ms of route())."""
    from duet.hashing import block_hashes
    from gateway.routing.policy import route
    from gateway.routing.prefix_index import SeenBlocks, WorkerBlockIndex
    from gateway.routing.route_types import RouteRequest, RoutingConfig, WorkerView

    rng = random.Random(0)
    workers = [WorkerView(f"w{i}", "m", "prefix" if i % 2 else "paged", "v1", frozenset({"n", "logprobs"}),
                          True, False, rng.randrange(8), 0, rng.random()) for i in range(8)]
    seen, index, config = SeenBlocks(), WorkerBlockIndex(), RoutingConfig()
    prompts = [[rng.randrange(32000) for _ in range(8000)] for _ in range(16)]
    for p in prompts:  # warm tables: these prompts were served before
        h = block_hashes(p, 16, "m", max_blocks=256)
        seen.add(h)
        index.add(workers[rng.randrange(8)].worker_id, h)
    hashing, only = [], []
    for i in range(samples):
        p = prompts[i % len(prompts)] if i % 2 else [rng.randrange(32000) for _ in range(8000)]
        t0 = time.perf_counter()
        h = tuple(block_hashes(p, 16, "m", max_blocks=256))
        t1 = time.perf_counter()
        route(RouteRequest("m", h, len(p), session_key=None, user_key=f"u{i}"), workers, config, None, seen, index)
        t2 = time.perf_counter()
        hashing.append(t1 - t0)
        only.append(t2 - t1)
    return _pct(hashing, 0.99) * 1000, _pct(only, 0.99) * 1000


# -- the run --------------------------------------------------------------------------------------
async def run(quick: bool) -> dict:
    from duet.model_make import default_model_dir
    from duet.tokenizer import Tokenizer

    model_dir = default_model_dir()
    model = model_dir.name
    # no restarts: a child that dies here is a failed run (nothing calls the supervisor's poll)
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="duet-gwbench-")))
    sim_ports = [free_port(), free_port()]
    gw_port = free_port()
    for i, p in enumerate(sim_ports):
        launcher.start_worker(f"sim{i}", WorkerSpec("sim", model_dir, p, sim=SimOptions(
            as_kind="prefix", ms_per_token=SIM_MS_PER_TOKEN)))
    try:
        for p in sim_ports:
            await _wait_port(launcher, p)
        prompt = "Summarize the benefits of paged attention for serving large language models."
        tok = Tokenizer.from_dir(model_dir)
        prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        per_stream = 3 if quick else 12
        max_tokens = 16
        result: dict = {"quick": quick, "sim_ms_per_token": SIM_MS_PER_TOKEN}
        # one-worker gateway for the overhead comparison (same worker as the direct client)
        launcher.start_gateway("gw1", gateway_config(model_dir, [f"127.0.0.1:{sim_ports[0]}"], port=gw_port,
                                                     poll_interval_s=1.0))
        await _wait_port(launcher, gw_port)
        await asyncio.sleep(1.5)  # the first health poll
        await gateway_ttfts(gw_port, model, prompt, 4, 1, 2)  # warm-up
        for conc, suffix in ((16, ""), (64, "_64")):
            direct = await direct_ttfts(f"127.0.0.1:{sim_ports[0]}", prompt_ids, conc, per_stream, max_tokens)
            via, errs = await gateway_ttfts(gw_port, model, prompt, conc, per_stream, max_tokens)
            result[f"direct_ttft_p50_ms{suffix}"] = round(_pct(direct, 0.5) * 1000, 3)
            result[f"gateway_ttft_p50_ms{suffix}"] = round(_pct(via, 0.5) * 1000, 3)
            result[f"overhead_ttft_p50_ms{suffix}"] = round((_pct(via, 0.5) - _pct(direct, 0.5)) * 1000, 3)
            result[f"overhead_ttft_p99_ms{suffix}"] = round((_pct(via, 0.99) - _pct(direct, 0.99)) * 1000, 3)
            result[f"ttft_errors{suffix}"] = errs
        launcher.supervisor.stop("gw1")
        # two workers behind one gateway for the 1,000-stream burst
        gw_port = free_port()
        launcher.start_gateway("gw2", gateway_config(model_dir, [f"127.0.0.1:{p}" for p in sim_ports], port=gw_port,
                                                     poll_interval_s=1.0))
        await _wait_port(launcher, gw_port)
        await asyncio.sleep(1.5)
        n = 1000
        errors, rps = await streams_burst(gw_port, model, n, 8 if quick else 16)
        result["streams_1000_errors"] = errors
        result["streams_1000_rps"] = round(rps, 1)
        hash_p99, route_p99 = route_decision_ms(200 if quick else 2000)
        result["route_decision_p99_ms"] = round(route_p99, 4)
        result["head_hash_p99_ms"] = round(hash_p99, 4)
        result["cpu_count"] = os.cpu_count()
        return result
    finally:
        launcher.shutdown()


def print_result(result: dict, as_json: bool) -> None:
    """A bench's result: one JSON object, or a line per figure."""
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:28s} {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.experiments.gateway_bench")
    ap.add_argument("--quick", action="store_true", help="fewer requests per stream")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args.quick))
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
