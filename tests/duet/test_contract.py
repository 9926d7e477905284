"""duet/contract.py is the one definition of what the gateway and the engines must agree on.

At each edge of each sampling range the gateway (a request body through its parser, and /openapi.json) and an
engine (`SamplingParams.validate`, what a gRPC caller meets) accept a value iff the contract does, and whatever
the gateway accepts is still valid to the engine after the wire (float32 fields, wrapped seeds). The sampling
defaults of the gateway, the engine and the RPC conversion are the contract's. The routing block size is
defined in duet/contract.py and nowhere else.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from duet import contract as c
from duet.rpc import engine_pb2 as pb
from engine_core.errors import InvalidRequestError
from engine_core.sampling_params import SamplingParams
from engine_core.servicer import sampling_from_pb
from gateway.api.messages_input import parse_messages
from gateway.api.protocol import Sampling, parse_chat, parse_completion
from gateway.errors import InvalidRequest
from gateway.openapi import DOCUMENT
from gateway.serving.generation import Prepared, to_pb

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 4096  # more than MAX_LOGIT_BIAS_TOKENS ids
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _step(bound: c.Bound, at: float) -> float:
    """The smallest move off an edge that still shows as a different number after JSON and float32."""
    return 1 if bound.integer else max(1e-6, abs(at) * 1e-6)


def edges(bound: c.Bound) -> list:
    """Just outside, on, and just inside each finite edge."""
    out = []
    for edge, inward in ((bound.lo, 1), (bound.hi, -1)):
        if edge is not None:
            step = _step(bound, edge)
            out += [edge - inward * step, edge, edge + inward * step]
    return out


def engine_accepts(**fields) -> bool:
    try:
        SamplingParams(**fields).validate(VOCAB)
    except InvalidRequestError:
        return False
    return True


def gateway_accepts(parse, body: dict) -> bool:
    """Whether the gateway takes `body`; if it does, the engine must take what the gateway sends it."""
    try:
        api = parse(body)
    except InvalidRequest:
        return False
    max_tokens = api.sampling.max_tokens or c.MAX_TOKENS.default
    prep = Prepared(api, None, "r", [1, 2, 3], "", max_tokens, "", None, None)
    sent = sampling_from_pb(to_pb(prep).sampling, default_max_tokens=max_tokens)
    sent.validate(VOCAB)  # raises: the gateway accepted what no engine serves
    return True


# (bound, engine fields for a value, API body for a value, edges where the API means something else)
SETTINGS = [
    (c.TEMPERATURE, lambda v: {"temperature": v}, lambda v: {**CHAT, "temperature": v}, ()),
    (c.TOP_P, lambda v: {"top_p": v}, lambda v: {**CHAT, "top_p": v}, ()),
    (c.TOP_K, lambda v: {"top_k": v}, lambda v: {**CHAT, "top_k": v}, ("lo",)),  # the API's 0: no cut
    (c.MIN_P, lambda v: {"min_p": v}, lambda v: {**CHAT, "min_p": v}, ()),
    (c.PRESENCE_PENALTY, lambda v: {"presence_penalty": v}, lambda v: {**CHAT, "presence_penalty": v}, ()),
    (c.FREQUENCY_PENALTY, lambda v: {"frequency_penalty": v}, lambda v: {**CHAT, "frequency_penalty": v}, ()),
    (c.REPETITION_PENALTY, lambda v: {"repetition_penalty": v}, lambda v: {**CHAT, "repetition_penalty": v}, ()),
    (c.SEED, lambda v: {"seed": v}, lambda v: {**CHAT, "seed": v}, ("lo",)),  # the API's seeds are signed too
    (c.N, lambda v: {"n": v}, lambda v: {**CHAT, "n": v}, ()),
    # beam search needs a width of 2 in the API (a beam of one is greedy decoding), as in vLLM
    (c.BEAM_WIDTH, lambda v: {"beam_width": v}, lambda v: {**CHAT, "use_beam_search": True, "best_of": v},
     ("lo",)),
    (c.LOGPROBS, lambda v: {"logprobs": v}, lambda v: {**CHAT, "logprobs": True, "top_logprobs": v}, ()),
    (c.PROMPT_LOGPROBS, lambda v: {"prompt_logprobs": v}, lambda v: {**CHAT, "prompt_logprobs": v}, ()),
    (c.LOGIT_BIAS, lambda v: {"logit_bias": ((5, v),)}, lambda v: {**CHAT, "logit_bias": {"5": v}}, ()),
    (c.MAX_TOKENS, lambda v: {"max_tokens": v}, lambda v: {**CHAT, "max_tokens": v}, ()),
    (c.MIN_TOKENS, lambda v: {"min_tokens": v, "max_tokens": c.MAX_TOKENS.hi},
     lambda v: {**CHAT, "min_tokens": v, "max_tokens": c.MAX_TOKENS.hi}, ()),
]


@pytest.mark.parametrize("bound, engine_fields, body, api_own", SETTINGS, ids=[s[0].name for s in SETTINGS])
def test_the_gateway_and_the_engine_take_a_value_iff_the_contract_does(bound, engine_fields, body, api_own):
    assert bound.lo is not None and bound.hi is not None  # every setting probed here has both edges
    own = [x for side in api_own for x in edges(c.Bound(bound.name, None, getattr(bound, side),
                                                        integer=bound.integer))]
    for value in edges(bound):
        admitted = bound.admits(value)
        assert engine_accepts(**engine_fields(value)) == admitted, f"engine, {bound.name}={value!r}"
        if value not in own:
            assert gateway_accepts(parse_chat, body(value)) == admitted, f"gateway, {bound.name}={value!r}"


def test_what_the_api_means_by_its_own_edges():
    assert gateway_accepts(parse_chat, {**CHAT, "top_k": 0})
    assert parse_chat({**CHAT, "top_k": 0}).sampling.top_k is None
    assert not gateway_accepts(parse_chat, {**CHAT, "top_k": -1})
    assert gateway_accepts(parse_chat, {**CHAT, "seed": -1})  # sent as 2**64 - 1
    assert gateway_accepts(parse_chat, {**CHAT, "seed": c.SEED_API_LOWEST})
    assert not gateway_accepts(parse_chat, {**CHAT, "seed": c.SEED_API_LOWEST - 1})
    assert not gateway_accepts(parse_chat, {**CHAT, "use_beam_search": True, "best_of": 1})
    completion = {"model": "m", "prompt": "hi"}
    assert gateway_accepts(parse_completion, {**completion, "logprobs": c.LOGPROBS.hi})
    assert not gateway_accepts(parse_completion, {**completion, "logprobs": c.LOGPROBS.hi + 1})


def test_the_request_size_limits_are_the_contracts():
    stops = [f"s{i}" for i in range(c.MAX_STOP_STRINGS)]
    assert gateway_accepts(parse_chat, {**CHAT, "stop": stops})
    assert not gateway_accepts(parse_chat, {**CHAT, "stop": stops + ["one more"]})
    bias = {str(i): 1.0 for i in range(c.MAX_LOGIT_BIAS_TOKENS)}
    assert gateway_accepts(parse_chat, {**CHAT, "logit_bias": bias})
    assert not gateway_accepts(parse_chat, {**CHAT, "logit_bias": {**bias, str(c.MAX_LOGIT_BIAS_TOKENS): 1.0}})
    messages = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    parse_messages({**messages, "stop_sequences": stops})
    with pytest.raises(InvalidRequest):
        parse_messages({**messages, "stop_sequences": stops + ["one more"]})


def test_the_wire_cannot_carry_an_accepted_number_out_of_its_range():
    """Floats travel as float32: an edge that rounds inwards would let the gateway accept a value the engine,
    after the trip, refuses (a top_p of 1e-9 arrives as 9.99999997e-10)."""
    floats = [b for b in vars(c).values() if isinstance(b, c.Bound) and not b.integer]
    assert {b.name for b in floats} >= {"temperature", "top_p", "repetition_penalty", "logit_bias"}
    for bound in floats:
        assert bound.lo is None or _float32(bound.lo) >= bound.lo, bound
        assert bound.hi is None or _float32(bound.hi) <= bound.hi, bound


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.mark.parametrize("model, field, bound", [
    ("ChatCompletionRequest", "temperature", c.TEMPERATURE), ("ChatCompletionRequest", "top_p", c.TOP_P),
    ("ChatCompletionRequest", "repetition_penalty", c.REPETITION_PENALTY), ("ChatCompletionRequest", "n", c.N),
    ("ChatCompletionRequest", "top_logprobs", c.LOGPROBS), ("CompletionRequest", "logprobs", c.LOGPROBS),
    ("ResponsesRequest", "temperature", c.TEMPERATURE), ("MessagesRequest", "top_p", c.TOP_P),
])
def test_openapi_shows_the_contracts_ranges(model, field, bound):
    schema = DOCUMENT["components"]["schemas"][model]["properties"][field]
    assert (schema["minimum"], schema["maximum"]) == (bound.lo, bound.hi)


def test_the_sampling_defaults_are_the_contracts_everywhere():
    engine, gateway = SamplingParams(), Sampling()
    over_the_wire = sampling_from_pb(pb.SamplingParams(), default_max_tokens=c.MAX_TOKENS.default)
    from_a_body = parse_chat(CHAT).sampling
    bounds = [c.TEMPERATURE, c.TOP_P, c.TOP_K, c.MIN_P, c.PRESENCE_PENALTY, c.FREQUENCY_PENALTY,
              c.REPETITION_PENALTY, c.SEED, c.N, c.BEAM_WIDTH, c.LENGTH_PENALTY, c.MIN_TOKENS, c.PROMPT_LOGPROBS]
    for bound in bounds:
        for name, params in (("engine", engine), ("gateway", gateway), ("rpc", over_the_wire),
                             ("api", from_a_body)):
            assert getattr(params, bound.name) == bound.default, f"{name} {bound.name}"
    assert engine.logprobs == over_the_wire.logprobs == c.LOGPROBS.default
    # max_tokens: the engine's own default, "fill the context" in the gateway (duet/contract.py says why)
    assert engine.max_tokens == c.MAX_TOKENS.default and gateway.max_tokens is None is from_a_body.max_tokens


def test_finish_reasons_round_trip_the_wire():
    on_the_wire = [r for r in c.FinishReason if r is not c.FinishReason.ERROR]
    assert [c.FINISH_FROM_PB[c.FINISH_TO_PB[r]] for r in on_the_wire] == ["stop", "length", "abort"]
    assert set(c.FINISH_TO_PB.values()) == set(pb.FinishReason.values()) - {pb.FINISH_REASON_UNSPECIFIED}


def test_each_kind_serves_its_own_capabilities_and_none_of_the_others():
    assert set(c.KIND_CAPABILITIES) == set(c.ENGINE_KINDS) and set(c.ENGINE_KINDS) < set(c.WORKER_KINDS)
    assert c.PAGED_CAPABILITIES <= set(c.KIND_CAPABILITIES[c.PAGED])
    assert c.PREFIX_CAPABILITIES <= set(c.KIND_CAPABILITIES[c.PREFIX])
    assert not c.PAGED_CAPABILITIES & set(c.KIND_CAPABILITIES[c.PREFIX])
    assert not c.PREFIX_CAPABILITIES & set(c.KIND_CAPABILITIES[c.PAGED])


# A routing/hash block size: a name about blocks (hash_block_size, block_tokens, HASH_BLOCK, DEFAULT_BLOCK_SIZE,
# ...) assigned, defaulted or keyed to a bare 16. Page sizes, batch sizes and other 16s are not matched.
_BLOCK_NAME = r"[A-Za-z_]*(?:block_size|block_tokens|hash_block|BLOCK_SIZE|BLOCK_TOKENS|HASH_BLOCK)[A-Za-z_]*"
_REDEFINED = re.compile(rf"\b{_BLOCK_NAME}\s*(?::[^=\n]*)?=(?!=)[^\n#]*(?<![\w.])16(?![\w.])")
SOURCE_DIRS = ("duet", "gateway", "engine_core", "engine_paged", "engine_prefix", "loadtests", "deploy")


def test_the_block_size_matcher_finds_what_it_must_and_nothing_else():
    for line in ("HASH_BLOCK = 16", "DEFAULT_BLOCK_SIZE = 16", "    block_tokens: int = 16  # tokens",
                 "hash_block_size: int = 16, clock", 'DEFAULT_BLOCK_SIZE = {"vllm": 128, "openai": 16}',
                 "x = f(hash_block_size=16)"):
        assert _REDEFINED.search(line), line
    for line in ("page_size: int = 16", "block_tokens: int = HASH_BLOCK_TOKENS", "max_hash_blocks: int = 256",
                 "block_size == 16", "BLOCK_SIZE = 160", "block_tokens = 1.16", "block_n = 16 if interp else 64"):
        assert not _REDEFINED.search(line), line


def test_the_routing_block_size_is_defined_in_the_contract_only():
    assert c.HASH_BLOCK_TOKENS == 16  # what every deployed worker and gateway hashes with today
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for top in SOURCE_DIRS for path in sorted((ROOT / top).rglob("*.py"))
             if path != ROOT / "duet" / "contract.py" and "rpc" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if _REDEFINED.search(line)]
    assert found == [], "a routing block size written outside duet/contract.py: import HASH_BLOCK_TOKENS"
