"""`HttpBackendClient`: an external vLLM, SGLang or OpenAI-compatible server behind the gateway's
`EngineClient` interface (gateway/backends/engine_client.py), so the fleet, routing, the watchdog, the
circuit breaker and gateway/serving/generation.py treat it like one of Duet's gRPC workers.

    generate        vLLM: POST /inference/v1/generate; others: POST /v1/completions (backend_wire.py)
    abort           vLLM: POST /inference/v1/abort_requests (closing the stream aborts it as well)
    get_info        GET /v1/models, then the tokenizer check: the backend's POST /tokenize of a probe
                    string must equal the gateway's own tokens, or the backend is refused (FAILED_PRECONDITION,
                    both token lists in the message and the log)
    get_load        GET /metrics, asking for the series it reads only (`name[]`; backend_load.py), and the
                    backend's prefill and decode rates from its counters' deltas since the last poll
    check_health    GET /health (an unreachable backend is logged once, naming it, until it answers); asked
                    every `health_every_s` (10 s) while the backend keeps answering (/metrics or a stream served to
                    its end within `health_fresh_s`), at once after a stream failed
    quiet backends  a backend with nothing in flight from this gateway, none started since the last poll, and no
                    work at the last poll (no request running or waiting: none of another client's either) is
                    asked /metrics and /health only every `idle_poll_s` (5 s): the other polls answer what the
                    last one saw. Its load cannot have moved through this gateway, and the stall watchdog only
                    watches a backend with work (a stream open: polled every poll again). What a quiet backend
                    is not told of: another gateway's or client's new requests, seen up to `idle_poll_s` late
    watch_kv_events the backend's ZMQ publisher, rehashed (kv_events_sub.py); UNIMPLEMENTED without one

A stream is a task pumping SSE chunks into a queue, so `cancel()` (a client gone, a stop string, the
watchdog) is synchronous, as the interface wants: it ends the pump, which closes the HTTP response (and its
connection: the backend sees the client go), and a pending read raises CancelledError, as a cancelled gRPC call
does.

The HTTP client is aiohttp's, not httpx's (which the CLI and the tests keep): in front of the same fake vLLM
servers, its reads of a stream and its polls cost the gateway a fraction of httpx's CPU per request
(docs/benchmarks.md, the gateway's CPU per request). Its session is made at the first request (aiohttp wants a
running event loop) and closed by `close()`. Timeouts: `request_timeout_s` (`timeouts.request_s`) bounds a whole
request, stream included, and so each wait for the backend's next bytes (httpx's read timeout, all it bounded
before; no read timeout of its own: `_http`); a connection is given 5 s; a poll (`rpc_timeout_s` or the caller's) the whole of its exchange.
Connections are kept alive for reuse, with no limit on how many are open. Proxy variables (HTTP_PROXY...) are not
read: backends are reached directly. Each request sent is logged at DEBUG (the polls: several a second).

CPU per request (profiled over HTTP backends, docs/benchmarks.md): each stream is read to the end of its body
after `[DONE]`, so its connection goes back to the pool (a response closed unread closes its connection, and
every request paid a new one), a backend that keeps answering is asked GET /health every 10 s, not every poll,
and a quiet one /metrics every 5 s: each GET through httpx cost about a millisecond of CPU (as much as a request's
own relay), and the polls were most of the gateway's CPU at a steady low rate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from urllib.parse import urlencode

import aiohttp
from yarl import URL

from duet.rpc import engine_pb2 as pb
from duet.sse import SseReader
from gateway.backends.backend_load import BusyRates, engine_load, metric_names
from gateway.backends.backend_spec import CAPABILITIES, BackendSpec
from gateway.backends.backend_wire import ChunkReader, WireError, completions_body, vllm_generate_body
from gateway.backends.engine_client import EngineCallError
from gateway.backends.kv_events_decode import KvRehasher
from gateway.backends.kv_events_sub import KvEventSubscriber

log = logging.getLogger("duet.gateway.backends")

PROBE = "Duet tokenizer probe: Paris, 東京, 12345 — naïve café? <|im_start|>"
_DONE = object()


class TokenizerMismatch(EngineCallError):
    def __init__(self, worker_id: str, details: str) -> None:
        super().__init__(worker_id, "FAILED_PRECONDITION", details, retryable=False)


class _HttpStream:
    def __init__(self, client: HttpBackendClient, request: pb.GenerateRequest) -> None:
        self._client, self._request = client, request
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False
        client.streamed_since_poll = True  # at once: a poll before the pump's first step is not quiet either
        self._pump = asyncio.ensure_future(self._run())

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        item = await self._queue.get()
        if item is _DONE or isinstance(item, BaseException):
            self._queue.put_nowait(item)  # the end is final: later reads end, or fail, the same way, never wait
        if item is _DONE:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        if self._pump.done() or self._cancelled:
            return
        self._cancelled = True
        self._pump.cancel()
        self._queue.put_nowait(asyncio.CancelledError())
        self._client.abort_later(self._request.request_id)

    async def _run(self) -> None:
        c = self._client
        c.streams_open += 1
        c.streamed_since_poll = True
        try:
            async for msg in c.stream_messages(self._request):
                self._queue.put_nowait(msg)
            self._queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except EngineCallError as e:
            if e.retryable:
                c.answered_at = -math.inf  # the next poll asks GET /health again
            self._queue.put_nowait(e)
        except Exception as e:  # noqa: BLE001 - every failure of the backend reaches the reader as one error
            c.answered_at = -math.inf
            self._queue.put_nowait(EngineCallError(c.worker_id, "INTERNAL", f"{type(e).__name__}: {e}", True))
        finally:
            c.streams_open -= 1


class HttpBackendClient:
    def __init__(self, spec: BackendSpec, models: dict, hash_block_size: int, rpc_timeout_s: float = 2.0,
                 request_timeout_s: float | None = None, health_fresh_s: float = 1.5,
                 health_every_s: float = 10.0, idle_poll_s: float = 5.0) -> None:
        self.spec, self.models, self.hash_block_size = spec, models, hash_block_size
        self.address = self.worker_id = spec.url
        self.rpc_timeout_s = rpc_timeout_s
        self.health_fresh_s, self.health_every_s = health_fresh_s, health_every_s
        self.idle_poll_s = idle_poll_s
        self.streams_open = 0  # this gateway's streams to it now
        self.streamed_since_poll = False  # a stream started since the last GET /metrics
        self._load: pb.EngineLoad | None = None  # what the last GET /metrics read
        self._polled_at = -math.inf  # time.monotonic() of that GET
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None  # made at the first request (`_http`)
        self.served_name: str | None = None  # the backend's name for the model
        self.model = None  # the gateway's ServedModel it serves
        self.rehasher: KvRehasher | None = None
        self.reachable: bool | None = None  # None: not asked yet
        self._tasks: set[asyncio.Task] = set()
        self._refused: str | None = None  # the last refusal logged
        self.answered_at = -math.inf  # time.monotonic() of the last stream served to its end or /metrics answered
        self._health_at = -math.inf  # time.monotonic() of the last GET /health that answered
        # only the series the load reads: prometheus_client's exposition honours `name[]`, so the page is
        # about a kilobyte instead of tens; a server that ignores it (vLLM 0.32: backend_load.py) sends it all
        self._metrics_path = "/metrics?" + urlencode([("name[]", n) for n in metric_names(spec.engine)])
        self._rates = BusyRates()  # its prefill and decode rates, from its counters' deltas between polls
        self._urls: dict[str, URL] = {}  # path -> the absolute URL (`_url`)

    def _url(self, path: str) -> URL:
        """The backend's URL of `path`, parsed once: a str URL would be parsed again at every request (for httpx
        that was 0.13 of the 1.86 ms of CPU a GET /metrics cost: docs/benchmarks.md)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.spec.url.rstrip("/") + path, encoded=True)
        return url

    @property
    def _http(self) -> aiohttp.ClientSession:
        """The session to the backend, made at its first use: aiohttp binds it to the running event loop."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),  # no cap on open connections; idle ones kept for reuse
                # no `sock_read`: `total` already bounds every wait within the request, and aiohttp moves a
                # sock_read timer at every read (a cancelled TimerHandle left in the loop's heap per token:
                # a tenth of the gateway's CPU per streamed token, profiled: docs/benchmarks.md)
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=5.0),
                json_serialize=_compact_json)
        return self._session

    def _timeout(self, timeout: float | None) -> aiohttp.ClientTimeout:
        """A poll's timeout: its whole exchange, connecting included."""
        return aiohttp.ClientTimeout(total=timeout or self.rpc_timeout_s)

    # -- generation -------------------------------------------------------------------------
    def generate(self, request: pb.GenerateRequest, metadata: tuple = ()) -> _HttpStream:
        return _HttpStream(self, request)

    async def stream_messages(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if self.spec.engine == "vllm":
                path, body, encode = "/inference/v1/generate", vllm_generate_body(request), None
            else:
                path, body = "/v1/completions", completions_body(request, self.served_name or "")
                encode = self.model.tokenizer.encode if self.model is not None else None
        except WireError as e:
            raise EngineCallError(self.worker_id, "INVALID_ARGUMENT", str(e), False) from None
        top = request.sampling.logprobs if request.sampling.HasField("logprobs") else 0
        reader = ChunkReader(len(request.prompt_token_ids), top, encode)
        try:
            async with self._http.post(self._url(path), json=body) as resp:
                log.debug("POST %s: HTTP %d", resp.url, resp.status)
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")[:500]
                    bad = 400 <= resp.status < 500 and resp.status not in (408, 429)
                    code = "INVALID_ARGUMENT" if bad else "RESOURCE_EXHAUSTED" if resp.status == 429 \
                        else "UNAVAILABLE"
                    raise EngineCallError(self.worker_id, code, f"HTTP {resp.status}: {text}", not bad)
                body = resp.content.iter_any()  # each read as it comes
                events = SseReader.from_bytes(body)  # the raw reads, split into lines once: duet/sse.py
                async for data in events:
                    for msg in reader.push(json.loads(data)):
                        yield msg
                if not events.done:
                    raise EngineCallError(self.worker_id, "UNAVAILABLE", "the stream ended before [DONE]", True)
                async for _ in body:
                    pass  # the body's end after [DONE]: a response read to its end leaves its connection open for
                    # the next request (closed unread, every request paid a new connection: profiled, module doc)
                self.answered_at = time.monotonic()
        except WireError as e:
            raise EngineCallError(self.worker_id, "INTERNAL", str(e), e.retryable) from None
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            raise EngineCallError(self.worker_id, "UNAVAILABLE", _failure(e), True) from None
        for msg in reader.finish():
            yield msg

    def abort_later(self, request_id: str) -> None:
        task = asyncio.ensure_future(self.abort(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort(self, request_id: str) -> bool:
        if self.spec.engine != "vllm":
            return False  # closing the stream is the abort
        try:
            # vLLM names the request "generate-tokens-<the id it was sent>" (its serving layer adds the prefix)
            async with self._http.post(self._url("/inference/v1/abort_requests"),
                                       json={"request_ids": [f"generate-tokens-{request_id}"]},
                                       timeout=self._timeout(None)) as r:
                await r.read()  # read to its end: the connection stays open for reuse
                log.debug("POST %s: HTTP %d", r.url, r.status)
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # -- control ----------------------------------------------------------------------------
    async def _get(self, path: str, timeout: float | None) -> bytes:
        """The body of GET `path`; anything but an HTTP 200 is UNAVAILABLE."""
        try:
            async with self._http.get(self._url(path), timeout=self._timeout(timeout)) as r:
                body = await r.read()
            log.debug("GET %s: HTTP %d", r.url, r.status)  # each poll, with --log-level debug only
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineCallError(self.worker_id, "UNAVAILABLE", f"GET {path}: {_failure(e)}", True) from None
        if r.status != 200:
            raise EngineCallError(self.worker_id, "UNAVAILABLE", f"GET {path}: HTTP {r.status}", True)
        return body

    async def get_info(self, timeout: float | None = None) -> pb.EngineInfo:
        try:
            listed = json.loads(await self._get("/v1/models", timeout)).get("data") or []
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise EngineCallError(self.worker_id, "UNAVAILABLE", f"GET /v1/models: {_failure(e)}", True) from None
        names = [m.get("id") for m in listed]
        model_id = next((n for n in names if n in self.models), None)
        if model_id is None and len(self.models) == 1 and listed:
            model_id = next(iter(self.models))  # one model each side: the backend may name it its own way
        if model_id is None:
            raise self._refuse(f"backend {self.worker_id} serves {names}, none of the gateway's "
                               f"models {list(self.models)}")
        self.model, self.served_name = self.models[model_id], names[0] if len(names) == 1 else model_id
        await self._check_tokenizer(timeout)
        self._refused = None
        max_len = next((m.get("max_model_len") for m in listed if m.get("max_model_len")), None)
        if self.rehasher is None or self.rehasher.model_id != model_id:
            self.rehasher = KvRehasher(model_id, self.hash_block_size)
        return pb.EngineInfo(engine_kind=self.spec.kind, model_id=model_id, version=self.spec.version,
                             page_size=self.spec.block_size, max_model_len=max_len or self.model.max_model_len,
                             capabilities=CAPABILITIES[self.spec.engine], hash_block_size=self.hash_block_size,
                             vocab_size=self.model.tokenizer.vocab_size, worker_id=self.worker_id)

    async def _check_tokenizer(self, timeout: float | None) -> None:
        ours = self.model.tokenizer.encode(PROBE, add_special_tokens=False)
        body = {"model": self.served_name, "prompt": PROBE, "add_special_tokens": False}
        for path in ("/tokenize", "/v1/tokenize"):  # vLLM's, then the OpenAI-prefixed one other servers have
            try:
                async with self._http.post(self._url(path), json=body, timeout=self._timeout(timeout)) as r:
                    status, answer = r.status, await r.read()
                log.debug("POST %s: HTTP %d", r.url, status)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise EngineCallError(self.worker_id, "UNAVAILABLE", f"POST {path}: {_failure(e)}", True) from None
            if status != 404:
                break
        if status != 200:
            raise self._refuse(f"backend {self.worker_id} cannot tokenize (POST /tokenize: HTTP {status}); "
                               f"the gateway needs it to check the backend's tokenizer is its own")
        theirs = json.loads(answer).get("tokens")
        if theirs != ours:
            raise self._refuse(f"backend {self.worker_id} tokenizes differently from the gateway's model "
                               f"{self.model.model_id}: probe {PROBE!r} -> backend {theirs}, gateway {ours}; "
                               f"pool refused")

    def _refuse(self, details: str) -> EngineCallError:
        if details != self._refused:  # polled every second: say it once
            log.error("%s", details)
            self._refused = details
        return TokenizerMismatch(self.worker_id, details)

    def quiet(self, now: float) -> bool:
        """Nothing moved its load since the last poll, which saw it idle, less than `idle_poll_s` ago (module doc)."""
        load = self._load
        return (self.reachable is True and load is not None and not (load.num_running or load.num_waiting)
                and not self.streams_open and not self.streamed_since_poll and now - self._polled_at < self.idle_poll_s)

    async def get_load(self, timeout: float | None = None) -> pb.EngineLoad:
        now = time.monotonic()
        if self.quiet(now):
            return self._load
        self.streamed_since_poll = False  # before the GET: a stream that starts while it waits is seen next poll
        page = (await self._get(self._metrics_path, timeout)).decode("utf-8", "replace")
        load = engine_load(page, self.spec.engine, self._rates)
        self._load, self._polled_at = load, now
        self.answered_at = time.monotonic()
        return load

    async def check_health(self, timeout: float | None = None) -> bool:
        now = time.monotonic()
        if self.quiet(now):
            return True  # it answered the last poll, saw nothing since that could change it (module doc)
        if self.reachable and now - self.answered_at < self.health_fresh_s and now - self._health_at < self.health_every_s:
            return True  # it answered since the last poll, and no stream failed since (module doc)
        try:
            await self._get("/health", timeout)
            self._health_at = now
        except EngineCallError as e:
            if self.reachable is not False:
                log.warning("%s backend %s is unreachable (%s); its pool waits for it, the others serve",
                            self.spec.engine, self.worker_id, e.details)
            self.reachable = False
            return False
        if self.reachable is False:
            log.info("%s backend %s answers again", self.spec.engine, self.worker_id)
        self.reachable = True
        return True

    async def watch_kv_events(self) -> AsyncIterator[pb.KvEventBatch]:
        if self.spec.kv_events is None or self.rehasher is None:
            raise EngineCallError(self.worker_id, "UNIMPLEMENTED", "no kv_events endpoint configured", False)
        self.rehasher.clear()
        sub = KvEventSubscriber(self.spec.kv_events, self.rehasher, self.worker_id)
        async for batch in sub.batches():
            yield batch
        raise EngineCallError(self.worker_id, "UNIMPLEMENTED", "KV events in an unknown format", False)

    @property
    def decode_tokens_per_step(self) -> float:
        """The batch its decode rate was measured at (0.0 until a poll shows one): the worker rows carry it, as
        GetLoad has no field for it."""
        return self._rates.decode_tokens_per_step

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._session is not None:
            await self._session.close()


def _compact_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _failure(e: BaseException) -> str:
    """An error's name and text; aiohttp's timeouts say nothing of themselves."""
    text = str(e) or ("timed out" if isinstance(e, TimeoutError) else "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def with_backends(factory, backends: tuple[BackendSpec, ...], models: dict, hash_block_size: int, timeouts=None,
                  idle_poll_s: float = 5.0):
    """A client factory (address -> EngineClient) that answers a backend's URL with its HTTP client and
    every other address with `factory` (Duet's gRPC workers)."""
    by_url = {b.url: b for b in backends}
    if not by_url:
        return factory

    def make(address: str):
        spec = by_url.get(address)
        if spec is None:
            return factory(address)
        return HttpBackendClient(spec, models, hash_block_size, rpc_timeout_s=getattr(timeouts, "rpc_s", 2.0),
                                 request_timeout_s=getattr(timeouts, "request_s", None), idle_poll_s=idle_poll_s)
    return make
