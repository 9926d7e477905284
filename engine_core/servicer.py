"""The gRPC face of an engine (duet.engine.v1.Engine): thin by design.

Protobuf becomes dataclasses at the boundary (`request_from_pb`, `output_to_pb`, ...) and every
error becomes a gRPC status in ONE place, `status_for`:

    InvalidRequestError      -> INVALID_ARGUMENT  (bad input; the message says what to fix)
    CapacityError            -> RESOURCE_EXHAUSTED (can never fit this worker)
    EngineOverloadedError    -> RESOURCE_EXHAUSTED (too many in flight; retry elsewhere)
    EngineDrainingError      -> UNAVAILABLE        (draining or still loading)
    anything else            -> INTERNAL

Each Generate is an "engine.generate" server span continuing the caller's W3C trace context from the
gRPC metadata (`duet.tracing.context_from_grpc`), so the gateway's client span is its parent. The span
carries the request id, engine kind, prompt and cached tokens; it ends with the stream (an error marks it).
"""

from __future__ import annotations

import functools
import inspect
import logging
import uuid

import grpc
from opentelemetry import trace

from duet import contract as c
from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc
from duet.tracing import context_from_grpc
from engine_core.errors import CapacityError, EngineDrainingError, EngineOverloadedError, InvalidRequestError
from engine_core.request import EngineSpec, KvEvent, LoadStats, Request, StepOutput
from engine_core.sampling_params import SamplingParams
from engine_core.step_loop import StepLoop

log = logging.getLogger(__name__)

_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, **c.FINISH_TO_PB}
_KV_KIND = {"stored": pb.KvEvent.STORED, "evicted": pb.KvEvent.EVICTED, "cleared": pb.KvEvent.CLEARED}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (CapacityError, EngineOverloadedError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineDrainingError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal engine error: {exc}"


def _mapped(method):
    """Run a unary or server-streaming handler, turning raised errors into a status."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - the one place errors become a status
                await context.abort(*status_for(exc))

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the one place errors become a status
            await context.abort(*status_for(exc))

    return unary


# -- protobuf <-> dataclasses --------------------------------------------------------------
def sampling_from_pb(s: pb.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """An unset optional field takes the contract's default (duet/contract.py), as SamplingParams() does."""
    constraint = s.WhichOneof("constraint")
    return SamplingParams(
        max_tokens=s.max_tokens or default_max_tokens,  # 0: up to the model's context
        temperature=s.temperature if s.HasField("temperature") else c.TEMPERATURE.default,
        top_p=s.top_p if s.HasField("top_p") else c.TOP_P.default,
        top_k=s.top_k if s.HasField("top_k") and s.top_k > 0 else c.TOP_K.default,
        min_p=s.min_p if s.HasField("min_p") else c.MIN_P.default,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty")
                            else c.REPETITION_PENALTY.default),
        seed=s.seed if s.HasField("seed") else c.SEED.default,
        logprobs=s.logprobs if s.HasField("logprobs") else c.LOGPROBS.default,
        stop_token_ids=tuple(s.stop_token_ids),
        min_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        n=max(c.N.default, s.n),  # 0: unset
        beam_width=max(c.BEAM_WIDTH.default, s.beam_width),
        length_penalty=s.length_penalty if s.HasField("length_penalty") else c.LENGTH_PENALTY.default,
        json_schema=s.json_schema if constraint == "json_schema" else None,
        json_object=constraint == "json_object" and s.json_object,
        regex=s.regex if constraint == "regex" else None,
        speculative=s.speculative if s.HasField("speculative") else None,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else c.PROMPT_LOGPROBS.default,
    )


def request_from_pb(r: pb.GenerateRequest, spec: EngineSpec) -> Request:
    """Validate and convert; raises InvalidRequestError naming the bad field."""
    prompt = list(r.prompt_token_ids)
    if not prompt:
        raise InvalidRequestError("prompt_token_ids is empty: a prompt needs at least one token")
    bad = next((t for t in prompt if t >= spec.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is not in this model's vocabulary (0..{spec.vocab_size - 1})")
    params = sampling_from_pb(r.sampling, max(1, spec.max_model_len - len(prompt)))
    params.validate(spec.vocab_size)
    return Request(r.request_id or uuid.uuid4().hex, prompt, params, r.cache_salt, r.priority,
                   report_started=r.report_started)


def output_to_pb(out: StepOutput) -> pb.GenerateResponse:
    if out.started:
        return pb.GenerateResponse(started=True)
    msg = pb.GenerateResponse(index=out.index, token_ids=out.token_ids, finish_reason=_FINISH[out.finish_reason],
                              cumulative_logprob=out.cumulative_logprob, replaces_previous=out.replaces_previous)
    if out.logprobs:
        for lp in out.logprobs:
            msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                             top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    for lp in out.prompt_logprobs or ():
        msg.prompt_logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if out.prompt_tokens is not None:
        msg.prompt.CopyFrom(pb.PromptInfo(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens or 0))
    return msg


def spec_to_pb(spec: EngineSpec) -> pb.EngineInfo:
    return pb.EngineInfo(engine_kind=spec.engine_kind, model_id=spec.model_id, version=spec.version,
                         page_size=spec.page_size, max_model_len=spec.max_model_len,
                         capabilities=list(spec.capabilities), kv_capacity_tokens=spec.kv_capacity_tokens,
                         kv_total_pages=spec.kv_total_pages, hash_block_size=spec.hash_block_size,
                         vocab_size=spec.vocab_size, worker_id=spec.worker_id)


def load_to_pb(load: LoadStats, draining: bool, num_steps: int = 0, prefill_tokens_per_s: float = 0.0,
               decode_tokens_per_s: float = 0.0, step_running_s: float = 0.0) -> pb.EngineLoad:
    return pb.EngineLoad(num_running=load.num_running, num_waiting=load.num_waiting,
                         num_steps=num_steps, prefill_tokens_per_s=prefill_tokens_per_s,
                         decode_tokens_per_s=decode_tokens_per_s, step_running_s=step_running_s,
                         kv_pages_used=load.kv_pages_used, kv_pages_total=load.kv_pages_total,
                         prefix_cache_queries_tokens=load.prefix_cache_queries_tokens,
                         prefix_cache_hits_tokens=load.prefix_cache_hits_tokens,
                         num_preemptions=load.num_preemptions, draining=draining,
                         spec_draft_tokens=load.spec_draft_tokens, spec_accepted_tokens=load.spec_accepted_tokens,
                         reused_pages_evicted=load.reused_pages_evicted)


def kv_events_to_pb(sequence: int, events: list[KvEvent]) -> pb.KvEventBatch:
    return pb.KvEventBatch(sequence=sequence, events=[
        pb.KvEvent(kind=_KV_KIND[e.kind], block_hashes=list(e.block_hashes), parent_hash=e.parent_hash)
        for e in events])


# -- the service ---------------------------------------------------------------------------
class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Until `attach` is called (the model is loading), Generate answers UNAVAILABLE."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.step_loop: StepLoop | None = None
        self.spec: EngineSpec | None = None
        self.tracer = trace.get_tracer("duet.engine", tracer_provider=tracer_provider)  # global provider if None

    def attach(self, step_loop: StepLoop, spec: EngineSpec) -> None:
        self.step_loop, self.spec = step_loop, spec

    def _ready(self) -> tuple[StepLoop, EngineSpec]:
        if self.step_loop is None or self.spec is None:
            raise EngineDrainingError("the engine is still loading its model")
        return self.step_loop, self.spec

    @_mapped
    async def Generate(self, request, context):
        # not start_as_current_span: an async generator may be closed from another context (a cancel),
        # where detaching the attached context would fail; nothing below starts child spans anyway
        span = self.tracer.start_span("engine.generate", context=context_from_grpc(context),
                                      kind=trace.SpanKind.SERVER,
                                      attributes={"duet.request_id": request.request_id,
                                                  "duet.prompt_tokens": len(request.prompt_token_ids)})
        try:
            loop, spec = self._ready()
            span.set_attribute("duet.engine", spec.engine_kind)
            async for out in loop.generate(request_from_pb(request, spec)):
                if out.started:
                    span.add_event("started")
                elif out.prompt_tokens is not None:
                    span.set_attribute("duet.cached_tokens", out.cached_tokens or 0)
                yield output_to_pb(out)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            raise
        finally:
            span.end()

    @_mapped
    async def Abort(self, request, context):
        loop, _ = self._ready()
        return pb.AbortResponse(found=loop.abort(request.request_id))

    @_mapped
    async def GetInfo(self, request, context):
        return spec_to_pb(self._ready()[1])

    @_mapped
    async def GetLoad(self, request, context):
        loop, _ = self._ready()
        return load_to_pb(loop.load, loop.draining, loop.num_steps, loop.rates.prefill_tokens_per_s,
                          loop.rates.decode_tokens_per_s, loop.step_running_s)

    @_mapped
    async def WatchKvEvents(self, request, context):
        loop, _ = self._ready()
        async for sequence, events in loop.kv_events():
            yield kv_events_to_pb(sequence, events)
