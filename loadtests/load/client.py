"""The benchmark client: streams `/v1/completions` from any OpenAI-compatible endpoint and times it.

Public API (used by `duet bench run` and `duet bench compare`):

    RequestRecord                      what one request measured (times in seconds)
    run_benchmark(url, model, requests, *, rate=None, concurrency=None, encode=None, ...) -> list[RequestRecord]
    arun_benchmark(...)                the same, awaitable inside a running event loop

Modes: `concurrency=C` is closed loop (C requests in flight; arrival times ignored); `rate=R` is
open loop with Poisson arrivals at R requests/s (`float("inf")`: all at once); neither: open loop at
the requests' own `arrival_s` (trace replay). A request with `depends_on` is sent only after its
parent finished, with the parent's prompt, its answer (`encode(text)`, cut to the parent's
max_tokens; no `encode`: no answer tokens) and its own tokens; if the parent failed it is not sent and
records the error "previous turn failed". In open loop a turn with `think_s` waits that long after its
parent finished (a user reading and typing); closed loop sends it at once. Records come back in the
order of `requests`. A request's `response_format` goes into its body as it is (structured output).

Each request is a streaming completion with a token-id prompt (with `decode`, the prompt decoded to text),
`ignore_eos`, temperature 0 and `stream_options.include_usage`. TTFT is the time to the first chunk carrying text (or the finish);
inter-token latencies are the gaps between later text chunks (a chunk may hold several tokens, e.g.
when a stop string is pending); output tokens come from the usage chunk (else the chunk count).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from duet.sse import SseReader
from loadtests.load.workloads import BenchRequest

ROUTE_HEADERS = ("x-duet-engine", "x-duet-variant", "x-duet-route-reason", "x-duet-worker")


@dataclass
class RequestRecord:
    request_id: str
    traffic_class: str
    session_id: str | None
    prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0  # when it was sent, seconds from the benchmark start
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # text chunks, seconds after start_s
    e2e_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    output_text: str = ""
    error: str | None = None
    engine: str | None = None
    variant: str | None = None
    route_reason: str | None = None
    worker: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # kept only with keep_prompts=True

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with one output token)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.start_s + (self.e2e_s or 0.0)


class _Bench:
    def __init__(self, url: str, model: str, requests: Sequence[BenchRequest], encode, api_key: str | None,
                 timeout_s: float, keep_prompts: bool, progress: bool, decode=None) -> None:
        self.url = url.rstrip("/") + ("/completions" if url.rstrip("/").endswith("/v1") else "/v1/completions")
        self.model, self.encode, self.keep = model, encode, keep_prompts
        self.decode = decode  # given: prompts go out as text (routers that hash text see text)
        self.requests = list(requests)
        ids = {r.request_id for r in self.requests}
        if len(ids) != len(self.requests):
            raise ValueError("request ids must be unique")
        for r in self.requests:
            if r.depends_on is not None and r.depends_on not in ids:
                raise ValueError(f"request {r.request_id} depends on unknown request {r.depends_on}")
        self.by_id = {r.request_id: r for r in self.requests}
        self.children: dict[str, list[BenchRequest]] = {}
        for r in self.requests:
            if r.depends_on is not None:
                self.children.setdefault(r.depends_on, []).append(r)
        self.records: dict[str, RequestRecord] = {}
        self.sent_prompt: dict[str, tuple[int, ...]] = {}
        self.done: dict[str, asyncio.Event] = {r.request_id: asyncio.Event() for r in self.requests}
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=len(self.requests), unit="req", desc="duet bench", leave=False)
        self.t0 = 0.0

    def _prompt(self, r: BenchRequest) -> tuple[int, ...] | None:
        if r.depends_on is None:
            return r.prompt_token_ids
        parent, rec = self.by_id[r.depends_on], self.records[r.depends_on]
        if not rec.ok:
            return None
        answer = list(self.encode(rec.output_text))[: parent.max_tokens] if self.encode else []
        return self.sent_prompt[parent.request_id] + tuple(answer) + r.prompt_token_ids

    async def one(self, r: BenchRequest) -> RequestRecord:
        if r.depends_on is not None:
            await self.done[r.depends_on].wait()
        prompt = self._prompt(r)
        rec = RequestRecord(r.request_id, r.traffic_class, r.session_id, len(prompt or ()), r.max_tokens,
                            start_s=time.perf_counter() - self.t0)
        if prompt is None:
            rec.error = "previous turn failed"
        else:
            self.sent_prompt[r.request_id] = prompt
            if self.keep:
                rec.prompt_token_ids = prompt
            await self._send(r, prompt, rec)
        self.records[r.request_id] = rec
        self.done[r.request_id].set()
        if self.bar is not None:
            self.bar.update(1)
        return rec

    async def _send(self, r: BenchRequest, prompt: tuple[int, ...], rec: RequestRecord) -> None:
        body = {"model": self.model, "prompt": self.decode(list(prompt)) if self.decode else list(prompt),
                "max_tokens": r.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": r.ignore_eos}
        if r.user is not None:
            body["user"] = r.user
        if r.response_format is not None:
            body["response_format"] = r.response_format
        headers = {"x-request-id": r.request_id}
        if r.session_id is not None:
            headers["x-session-id"] = r.session_id
        start = time.perf_counter()
        rec.start_s = start - self.t0
        texts: list[str] = []
        try:
            async with self.http.stream("POST", self.url, json=body, headers=headers) as resp:
                rec.engine, rec.variant, rec.route_reason, rec.worker = (resp.headers.get(h) for h in ROUTE_HEADERS)
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {_error_message((await resp.aread()).decode(errors='replace'))}"
                    return
                async for data in SseReader(resp.aiter_lines()):
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = f"stream error: {_error_message(data)}"
                        break
                    now = time.perf_counter() - start
                    for choice in obj.get("choices") or ():
                        text = choice.get("text") or ""
                        if text or choice.get("finish_reason"):
                            if rec.ttft_s is None:
                                rec.ttft_s = now
                            if text:
                                texts.append(text)
                                rec.chunk_times_s.append(now)
                    usage = obj.get("usage")
                    if usage:
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except (httpx.HTTPError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as e:
            # a broken server answer is this request's error, never the whole benchmark's
            rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        rec.e2e_s = time.perf_counter() - start
        rec.output_text = "".join(texts)
        if rec.output_tokens == 0:
            rec.output_tokens = len(rec.chunk_times_s)
        if rec.error is None and rec.ttft_s is None:
            rec.error = "the stream ended without a token"

    async def open_loop(self, arrivals: dict[str, float]) -> None:
        async def at(r: BenchRequest) -> None:
            delay = arrivals.get(r.request_id, 0.0) - (time.perf_counter() - self.t0)
            if r.depends_on is not None:
                await self.done[r.depends_on].wait()  # then its think time, then its own time, if later
                if r.think_s > 0:
                    await asyncio.sleep(r.think_s)
                delay = arrivals.get(r.request_id, 0.0) - (time.perf_counter() - self.t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await self.one(r)

        await asyncio.gather(*(at(r) for r in self.requests))

    async def closed_loop(self, concurrency: int) -> None:
        # ready requests; a finished turn's next turn goes first, so conversations keep moving
        ready = deque(r for r in self.requests if r.depends_on is None)
        wake = asyncio.Condition()
        remaining = len(self.requests)

        def ready_or_finished() -> bool:
            return bool(ready) or remaining == 0

        async def worker() -> None:
            nonlocal remaining
            while True:
                async with wake:
                    await wake.wait_for(ready_or_finished)
                    if not ready:
                        return
                    r = ready.popleft()
                try:
                    await self.one(r)
                finally:  # even on an unexpected error, so the other workers do not wait forever
                    async with wake:
                        remaining -= 1
                        ready.extendleft(reversed(self.children.get(r.request_id, [])))
                        wake.notify_all()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:200]


def poisson_arrivals(requests: Sequence[BenchRequest], rate: float, seed: int = 0) -> dict[str, float]:
    """Arrival times at `rate` requests/s for the requests that start a chain (a dependent turn
    follows its parent); `inf`: all at time 0."""
    rng = random.Random(seed)
    t, out = 0.0, {}
    for r in requests:
        if r.depends_on is None:
            out[r.request_id] = t
            if rate != float("inf"):
                t += rng.expovariate(rate)
    return out


async def arun_benchmark(url: str, model: str, requests: Sequence[BenchRequest], *, rate: float | None = None,
                         concurrency: int | None = None, encode: Callable[[str], list[int]] | None = None,
                         api_key: str | None = None, timeout_s: float = 600.0, keep_prompts: bool = False,
                         progress: bool = True, seed: int = 0,
                         decode: Callable[[list[int]], str] | None = None) -> list[RequestRecord]:
    if rate is not None and concurrency is not None:
        raise ValueError("give --rate or --concurrency, not both")
    if rate is not None and not rate > 0:
        raise ValueError(f"--rate must be positive, got {rate}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    if rate is None and concurrency is None and any(r.arrival_s is None and r.depends_on is None for r in requests):
        raise ValueError("this workload has no arrival times: give --rate R or --concurrency C")
    bench = _Bench(url, model, requests, encode, api_key, timeout_s, keep_prompts, progress, decode)
    try:
        bench.t0 = time.perf_counter()
        if concurrency is not None:
            await bench.closed_loop(concurrency)
        else:
            arrivals = (poisson_arrivals(requests, rate, seed) if rate is not None
                        else {r.request_id: r.arrival_s for r in requests if r.arrival_s is not None})
            await bench.open_loop(arrivals)
    finally:
        await bench.http.aclose()
        if bench.bar is not None:
            bench.bar.close()
    return [bench.records[r.request_id] for r in requests]


def run_benchmark(url: str, model: str, requests: Sequence[BenchRequest], **kwargs) -> list[RequestRecord]:
    """Runs `arun_benchmark` in a fresh event loop (see the module docstring for the arguments)."""
    return asyncio.run(arun_benchmark(url, model, requests, **kwargs))
