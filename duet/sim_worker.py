"""`duet engine sim`: a model-free worker that speaks the whole engine proto.

It paces tokens like a real engine (prefill time per uncached prompt token, then a fixed time per
decoded token), keeps a simulated prefix cache (an LRU of duet.hashing block hashes, reported on
WatchKvEvents and in `PromptInfo.cached_tokens`), accounts KV pages per running request so GetLoad
shows pages coming back on abort or cancel, and serves grpc.health.v1. It has no queue: a request
starts at once (a `started` message when asked), and its prefill and tokens advance `num_steps` as a
real engine's steps do, in ticks of at most PREFILL_TICK_S (a frozen sim stops advancing it). Token ids are
deterministic: a seeded RNG (the request's seed, else a hash of the prompt) over the model's vocabulary. A
request's `logit_bias` weighs that draw as it would weigh logits (weight e**bias: -100 bans a token,
+100 all but forces it). `prompt_logprobs` get made-up values (there is no model to score with).

It is light: one coroutine per stream and no per-token work beyond an RNG draw, so one process can
hold thousands of concurrent streams for gateway load tests. Torch-free: `duet up --sim` and the gateway's
tests run it where no engine could. `SimSpec` is what one sim worker is (model facts, timing, cache size);
`spec_for` reads it from `duet engine sim`'s flags (duet.engine_config.SimConfig) and the model directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import random
import signal
from collections import OrderedDict
from dataclasses import dataclass

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from duet.contract import KIND_CAPABILITIES
from duet.engine_config import SimConfig
from duet.hashing import block_hashes
from duet.registry import Registration, advertised_address, worker_info
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from duet.tracing import context_from_grpc

log = logging.getLogger("duet.sim")

PREFILL_TICK_S = 0.05  # a long simulated prefill advances the step counter this often


_FLAGS = SimConfig()  # the defaults of `duet engine sim`'s flags


@dataclass(frozen=True)
class SimSpec:
    model_id: str = "sim"
    engine_kind: str = _FLAGS.sim_as
    version: str = _FLAGS.engine.version
    worker_id: str = "sim"
    page_size: int = _FLAGS.engine.page_size
    max_model_len: int = 4096
    vocab_size: int = 256
    excluded_ids: frozenset[int] = frozenset()  # special tokens the sim never samples
    capabilities: tuple[str, ...] = KIND_CAPABILITIES[_FLAGS.sim_as]
    ms_per_token: float = _FLAGS.sim_ms_per_token
    prefill_ms_per_token: float = _FLAGS.sim_prefill_ms_per_token
    fail_rate: float = _FLAGS.sim_fail_rate
    cache_blocks: int = _FLAGS.sim_cache_blocks
    load_s: float = _FLAGS.sim_load_s  # NOT_SERVING this long after it listens, like an engine loading its model


class SimCache:
    """LRU of block hashes standing in for a radix cache; every change becomes a KvEvent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._watchers: list[asyncio.Queue] = []
        self._sequence = 0

    def match_and_insert(self, hashes: list[int]) -> int:
        """Returns how many leading blocks were cached, then stores all of them (touching LRU order)."""
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hit += 1
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        events = []
        new = hashes[hit:]
        if new:
            parent = hashes[hit - 1] if hit else 0
            events.append(pb.KvEvent(kind=pb.KvEvent.STORED, block_hashes=new, parent_hash=parent))
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            events.append(pb.KvEvent(kind=pb.KvEvent.EVICTED, block_hashes=evicted))
        if events:
            self._publish(events)
        return hit

    def _publish(self, events: list) -> None:
        self._sequence += 1
        batch = pb.KvEventBatch(sequence=self._sequence, events=events)
        for q in self._watchers:
            if q.qsize() < 10_000:  # a stuck watcher loses events; the gap in `sequence` says so
                q.put_nowait(batch)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._watchers.remove(q)


class SimEngine(pb_grpc.EngineServicer):
    """The Engine service over simulated time; `aborted` counts aborts and cancels (tests read it)."""

    def __init__(self, config: SimSpec, tracer_provider=None) -> None:
        self.config = config
        self.tracer = trace.get_tracer("duet.sim", tracer_provider=tracer_provider)
        self.cache = SimCache(config.cache_blocks)
        self.running: dict[str, int] = {}  # request id -> KV pages held
        self.abort_flags: dict[str, asyncio.Event] = {}
        self.aborted = 0
        self.num_steps = 0  # progress, as a real engine's step counter (GetLoad)
        self.draining = False
        self._fail_rng = random.Random(0)
        self._ids = [i for i in range(config.vocab_size) if i not in config.excluded_ids]

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    async def Generate(self, request, context):
        # the engine-side span of the gateway's trace (W3C context from the gRPC metadata)
        with self.tracer.start_as_current_span("engine.generate", context=context_from_grpc(context),
                                               kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("duet.request_id", request.request_id)
            async for msg in self._generate(request, context):
                yield msg

    async def _generate(self, request, context):
        cfg = self.config
        rid = request.request_id or f"sim-{id(request)}"
        prompt = list(request.prompt_token_ids)
        sp = request.sampling
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        if len(prompt) + sp.max_tokens > cfg.max_model_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(prompt)} tokens) + max_tokens ({sp.max_tokens}) exceeds max_model_len {cfg.max_model_len}",
            )
        if cfg.fail_rate and self._fail_rng.random() < cfg.fail_rate:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sim: injected failure")
        n = max(1, sp.n)
        abort = asyncio.Event()
        self.abort_flags[rid] = abort
        self.running[rid] = self._pages(len(prompt)) * n
        try:
            hashes = block_hashes(prompt, cfg.page_size, cfg.model_id, request.cache_salt)
            cached = self.cache.match_and_insert(hashes) * cfg.page_size
            if request.report_started:
                yield pb.GenerateResponse(started=True)
            prefill_s = (len(prompt) - cached) * cfg.prefill_ms_per_token / 1000
            while prefill_s > 0:
                await asyncio.sleep(min(prefill_s, PREFILL_TICK_S))
                prefill_s -= PREFILL_TICK_S
                self.num_steps += 1
            seed = sp.seed if sp.HasField("seed") else _prompt_seed(prompt)
            rngs = [random.Random(seed * 1000003 + i) for i in range(n)]
            draw = self._draw(dict(sp.logit_bias))
            stop_ids = set(sp.stop_token_ids)
            prompt_info = pb.PromptInfo(prompt_tokens=len(prompt), cached_tokens=cached)
            done = [False] * n
            cumulative = [0.0] * n
            for step in range(sp.max_tokens):
                if step:
                    await asyncio.sleep(cfg.ms_per_token / 1000)
                if abort.is_set():
                    for i in range(n):
                        if not done[i]:
                            yield pb.GenerateResponse(index=i, finish_reason=pb.FINISH_REASON_ABORT)
                    return
                self.running[rid] = self._pages(len(prompt) + step + 1) * n
                self.num_steps += 1
                for i in range(n):
                    if done[i]:
                        continue
                    msg = self._token(rngs[i], draw, sp, step, stop_ids, cumulative, i)
                    done[i] = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    if step == 0 and i == 0:
                        msg.prompt.CopyFrom(prompt_info)
                        if sp.HasField("prompt_logprobs"):
                            msg.prompt_logprobs.extend(_made_up_prompt_logprobs(prompt, sp.prompt_logprobs))
                    yield msg
                if all(done):
                    return
        except asyncio.CancelledError:
            self.aborted += 1  # the client went away: free its pages now, like a real engine
            raise
        finally:
            if abort.is_set():
                self.aborted += 1
            self.running.pop(rid, None)
            self.abort_flags.pop(rid, None)

    def _draw(self, bias: dict[int, float]):
        """rng -> token id: uniform over the vocabulary, or weighted by e**bias when a logit bias is given."""
        ids = self._ids
        if not bias:
            return lambda rng: ids[rng.randrange(len(ids))]
        weights = [math.exp(bias.get(t, 0.0)) for t in ids]
        cumulative = list(itertools.accumulate(weights))
        return lambda rng: rng.choices(ids, cum_weights=cumulative)[0]

    def _token(self, rng, draw, sp, step, stop_ids, cumulative, index):
        token = draw(rng)
        lp = -rng.random() * 2
        cumulative[index] += lp
        msg = pb.GenerateResponse(index=index, token_ids=[token], cumulative_logprob=cumulative[index])
        if sp.HasField("logprobs"):
            top = [pb.TopLogprob(token_id=token, logprob=lp)]
            for k in range(1, sp.logprobs):
                top.append(pb.TopLogprob(token_id=self._ids[(token + k) % len(self._ids)], logprob=lp - k))
            msg.logprobs.append(pb.TokenLogprob(token_id=token, logprob=lp, top=top[: sp.logprobs]))
        if token in stop_ids and step + 1 >= sp.min_tokens:
            msg.finish_reason = pb.FINISH_REASON_STOP
        elif step + 1 >= sp.max_tokens:
            msg.finish_reason = pb.FINISH_REASON_LENGTH
        return msg

    async def Abort(self, request, context):
        flag = self.abort_flags.get(request.request_id)
        if flag is not None:
            flag.set()
        return pb.AbortResponse(found=flag is not None)

    async def GetInfo(self, request, context):
        cfg = self.config
        return pb.EngineInfo(
            engine_kind=cfg.engine_kind, model_id=cfg.model_id, version=cfg.version,
            page_size=cfg.page_size, max_model_len=cfg.max_model_len, capabilities=cfg.capabilities,
            kv_capacity_tokens=cfg.cache_blocks * cfg.page_size, kv_total_pages=cfg.cache_blocks,
            hash_block_size=cfg.page_size, vocab_size=cfg.vocab_size, worker_id=cfg.worker_id,
        )

    async def GetLoad(self, request, context):
        return pb.EngineLoad(
            num_running=len(self.running), num_waiting=0,
            kv_pages_used=min(sum(self.running.values()), self.config.cache_blocks),
            kv_pages_total=self.config.cache_blocks, draining=self.draining, num_steps=self.num_steps,
        )

    async def WatchKvEvents(self, request, context):
        q = self.cache.subscribe()
        try:
            while True:
                yield await q.get()
        finally:
            self.cache.unsubscribe(q)


def _made_up_prompt_logprobs(prompt: list[int], k: int) -> list[pb.TokenLogprob]:
    rng = random.Random(_prompt_seed(prompt))
    out = []
    for token in prompt[1:]:
        lp = -rng.random() * 4
        out.append(pb.TokenLogprob(token_id=token, logprob=lp,
                                   top=[pb.TopLogprob(token_id=token, logprob=lp)][:k]))
    return out


def _prompt_seed(prompt: list[int]) -> int:
    digest = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def spec_for(config: SimConfig) -> SimSpec:
    """The sim worker `duet engine sim`'s flags describe; with a model, its vocabulary, context and ids."""
    engine = config.engine
    kind = config.sim_as
    capabilities = config.sim_capabilities if config.sim_capabilities is not None else KIND_CAPABILITIES[kind]
    extra = {}
    if engine.model:
        from duet.model_dir import read_model_dir

        md = read_model_dir(engine.model, weights=False)  # a sim reads config.json alone
        c = md.config
        special = set(c.eos_token_ids) | ({c.bos_token_id} if c.bos_token_id is not None else set())
        extra = {"model_id": md.model_id, "max_model_len": c.max_position_embeddings,
                 "vocab_size": c.vocab_size, "excluded_ids": frozenset(special)}
    return SimSpec(
        engine_kind=kind, version=engine.version, worker_id=engine.worker_label, page_size=engine.page_size,
        capabilities=tuple(capabilities), ms_per_token=config.sim_ms_per_token,
        prefill_ms_per_token=config.sim_prefill_ms_per_token, fail_rate=config.sim_fail_rate,
        cache_blocks=config.sim_cache_blocks, load_s=config.sim_load_s, **extra,
    )


async def serve(config: SimSpec, host: str, port: int, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, tracer_provider=None, engine_out: list | None = None,
                redis_url: str | None = None) -> None:
    """Runs the sim worker until `stop` is set (or SIGTERM/SIGINT when run as a process)."""
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100_000)])
    engine = SimEngine(config, tracer_provider)
    if engine_out is not None:
        engine_out.append(engine)  # tests read its counters
    pb_grpc.add_EngineServicer_to_server(engine, server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{host}:{port}")
    stop = stop or asyncio.Event()
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    if config.load_s > 0:
        log.info("sim worker %s (%s) listening on %s:%d, loading for %.1f s", config.worker_id, config.engine_kind,
                 host, port, config.load_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), config.load_s)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("sim worker %s (%s) serving on %s:%d", config.worker_id, config.engine_kind, host, port)
    registration = None
    if redis_url:  # heartbeat into the gateways' registry, exactly as the real engines do
        registration = Registration(redis_url, worker_info(
            config.worker_id, advertised_address(host, port), config.engine_kind, config.model_id, config.version))
        registration.start()
    if ready is not None:
        ready.set()
    await stop.wait()
    if registration is not None:
        await registration.stop()
    engine.draining = True
    await health.enter_graceful_shutdown()
    await server.stop(grace=1.0)


def main(config: SimConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = spec_for(config)
    engine = config.engine

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(spec, engine.host, engine.port, stop=stop, redis_url=engine.redis)

    asyncio.run(run())
    return 0
