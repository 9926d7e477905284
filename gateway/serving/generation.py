"""One request's path through the gateway: tokens in, routed gRPC stream, text deltas out.

    prepare()  render + tokenize, check the context length
    to_pb()    the engine's GenerateRequest
    Dispatched what dispatch (gateway/serving/dispatch.py: route, open the stream, retry on other
               workers) returns; the caller must `close()` it (it cancels the gRPC call)
    deadline   the client's `timeout` (Prepared.deadline) ends the request wherever it is: queued,
               prefilling, or (without streaming) generating; the engine aborts it (408, no retry)
    outputs()  engine messages -> per-choice `Delta`s (incremental detokenizer + stop strings);
               an engine failure after the first message raises EngineFailure (the API layer
               turns it into an error event: a stream is never silently truncated)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from duet.contract import FINISH_FROM_PB
from duet.detokenizer import IncrementalDetokenizer
from duet.rpc import engine_pb2 as pb
from duet.tokenizer import ChatTemplateError, TokenizerError
from gateway import errors
from gateway.backends.engine_client import EngineCallError, GenerateStream
from gateway.models import ServedModel
from gateway.routing.route_types import RouteDecision
from gateway.serving.api_request import ApiRequest
from gateway.serving.stops import StopMatcher
from gateway.serving.timeouts import ClientDeadline
from gateway.serving.tools import render_chat


@dataclass(frozen=True)
class Prepared:
    api: ApiRequest
    model: ServedModel
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    cache_salt: str
    session_key: str | None
    variant_override: str | None
    arrival: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # time.monotonic() when the client's own timeout passes; None: none
    tenant: str | None = None  # the API key's id (flow control's fairness key); None: the API is open


@dataclass
class Delta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob, one per token id
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended this choice (finish_reason "stop")


def prepare(api: ApiRequest, model: ServedModel, request_id: str, cache_salt: str,
            session_key: str | None, variant_override: str | None, default_max_tokens: int | None) -> Prepared:
    tok = model.tokenizer
    try:
        if api.kind == "chat":
            messages, tools = render_chat(list(api.messages), api.tools, tok.template_takes_tools)
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
            ids = tok.encode(text)
        elif isinstance(api.prompt, str):
            text, ids = api.prompt, tok.encode(api.prompt, add_special_tokens=True)
        else:
            ids = list(api.prompt)
            if max(ids) >= tok.vocab_size:
                raise errors.InvalidRequest(f"token id {max(ids)} is out of the vocabulary ({tok.vocab_size})",
                                            "prompt")
            text = tok.decode(ids) if api.echo else ""
    except ChatTemplateError as e:
        raise errors.InvalidRequest(f"messages rejected by the chat template: {e}", "messages") from None
    except TokenizerError as e:
        raise errors.InvalidRequest(f"the prompt cannot be tokenized: {e}", "messages" if api.kind == "chat"
                                    else "prompt") from None
    if not ids:
        raise errors.InvalidRequest("the prompt is empty after tokenization", "prompt")
    bad_bias = [t for t, _ in api.sampling.logit_bias if t >= tok.vocab_size]
    if bad_bias:
        raise errors.InvalidRequest(f"logit_bias token id {bad_bias[0]} is out of the vocabulary ({tok.vocab_size})",
                                    "logit_bias")
    room = model.max_model_len - len(ids)
    max_tokens = api.sampling.max_tokens
    param = "messages" if api.kind == "chat" else "prompt"
    if max_tokens is None:
        if room < 1:
            raise errors.ContextLengthExceeded(len(ids) + 1, model.max_model_len, param)
        max_tokens = room if default_max_tokens is None else min(room, default_max_tokens)
    elif len(ids) + max_tokens > model.max_model_len:
        raise errors.ContextLengthExceeded(len(ids) + max_tokens, model.max_model_len, param)
    return Prepared(api, model, request_id, ids, text, max_tokens, cache_salt, session_key, variant_override)


def to_pb(prep: Prepared) -> pb.GenerateRequest:
    s = prep.api.sampling
    # max_tokens 0 (scoring the prompt): the engine makes one token, which outputs() drops
    sp = pb.SamplingParams(
        max_tokens=max(1, prep.max_tokens), temperature=s.temperature, top_p=s.top_p, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, stop_token_ids=list(s.stop_token_ids),
        min_tokens=s.min_tokens, ignore_eos=s.ignore_eos, n=s.n,
    )
    if s.top_k:
        sp.top_k = s.top_k
    if s.seed is not None:
        sp.seed = s.seed % (1 << 64)
    if s.logprobs:
        sp.logprobs = s.top_logprobs
    tool_schema = prep.api.tools.constraint() if prep.api.tools else None
    if tool_schema is not None:
        sp.json_schema = tool_schema
    elif s.json_schema is not None:
        sp.json_schema = s.json_schema
    elif s.json_object:
        sp.json_object = True
    elif s.regex is not None:
        sp.regex = s.regex
    if s.beam_width > 1:
        sp.beam_width = s.beam_width
    if s.length_penalty != 1.0:
        sp.length_penalty = s.length_penalty
    if s.speculative is not None:
        sp.speculative = s.speculative
    if s.logit_bias:
        sp.logit_bias.update(dict(s.logit_bias))
    if s.prompt_logprobs is not None:
        sp.prompt_logprobs = s.prompt_logprobs
    # report_started: the first-token deadline runs from the engine's start, not from the queue
    return pb.GenerateRequest(request_id=prep.request_id, prompt_token_ids=prep.prompt_ids,
                              sampling=sp, cache_salt=prep.cache_salt, priority=s.priority,
                              report_started=True)


@dataclass
class Dispatched:
    decision: RouteDecision
    stream: GenerateStream
    messages: AsyncIterator
    first: pb.GenerateResponse
    attempts: int
    span: trace.Span | None = None
    block_hashes: tuple[int, ...] = ()  # the prompt head's routing hashes (the workload profile reads them)

    def close(self) -> None:
        self.stream.cancel()
        if self.span is not None:
            self.span.end()
            self.span = None


class _Choice:
    def __init__(self, prep: Prepared, index: int) -> None:
        self.tokenizer = prep.model.tokenizer
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self.stops = StopMatcher(prep.api.sampling.stop)
        self.index = index
        self.num_tokens = 0
        self.done = False


async def outputs(prep: Prepared, d: Dispatched, usage: dict) -> AsyncIterator[Delta]:
    """Per-choice deltas until every choice finished. Keeps `usage` (the caller's dict of prompt, cached and
    completion tokens, the prompt's counted from the first message) true as of each delta it yields."""
    n = prep.api.sampling.n
    choices = [_Choice(prep, i) for i in range(n)]
    msg = d.first
    while True:
        if msg is not d.first and msg.HasField("prompt"):  # an HTTP backend says its cache hit at the end
            usage["cached_tokens"] = msg.prompt.cached_tokens
        c = choices[msg.index] if msg.index < n else None
        if c is not None and not c.done:
            delta = _step(c, msg) if prep.max_tokens else _scored_only(c, msg)
            usage["completion_tokens"] = sum(ch.num_tokens for ch in choices)
            yield delta
        if all(ch.done for ch in choices):
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                await _read_trailer(d)
            return
        try:
            msg = await d.messages.__anext__()
        except StopAsyncIteration:
            raise errors.EngineFailure(f"worker {d.decision.worker_id} ended the stream before every choice "
                                       f"finished") from None
        except ClientDeadline as e:
            raise errors.RequestTimeout(f"the request's timeout passed while it was generating ({e.details})") \
                from None
        except EngineCallError as e:
            raise errors.EngineFailure(f"worker {d.decision.worker_id} failed mid-stream: {e.code}: "
                                       f"{e.details}") from None


async def _read_trailer(d: Dispatched) -> None:
    """The engine finished every choice: read the end of the stream (its status) so the call completes
    normally instead of being cancelled (a cancel costs the engine and the gRPC core more)."""
    try:
        await d.messages.__anext__()
    except (StopAsyncIteration, EngineCallError):
        pass


def _scored_only(c: _Choice, msg: pb.GenerateResponse) -> Delta:
    """max_tokens 0: the engine ran the prompt (for its logprobs) and made one token nobody asked for."""
    if msg.finish_reason == pb.FINISH_REASON_ABORT:
        raise errors.EngineFailure("the engine aborted the request")
    c.done = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return Delta(c.index, finish_reason="length" if c.done else None)


def _step(c: _Choice, msg: pb.GenerateResponse) -> Delta:
    if msg.replaces_previous:  # a finished beam arrives whole
        c.detok = IncrementalDetokenizer(c.tokenizer)
        c.num_tokens = 0
    ids = list(msg.token_ids)
    c.num_tokens += len(ids)
    text = c.stops.push(c.detok.push(ids))
    finish = None
    if c.stops.stopped:
        finish = "stop"
    elif msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        if msg.finish_reason == pb.FINISH_REASON_ABORT:
            raise errors.EngineFailure("the engine aborted the request")
        text += c.stops.push(c.detok.flush())
        finish = "stop" if c.stops.stopped else FINISH_FROM_PB.get(msg.finish_reason, "stop")
        text += c.stops.flush()
    c.done = finish is not None
    return Delta(c.index, text, ids, list(msg.logprobs), finish, c.stops.matched if c.stops.stopped else None)
