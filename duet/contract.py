"""What the gateway, the engines and the simulators must agree on, written once: the routing block size, the
engine kinds, the capabilities, the finish reasons (and their proto enums), and every sampling setting with
its default and range. Plain Python (the protobuf stubs aside), so the gateway, the sim worker and the
simulators import it without torch.

    HASH_BLOCK_TOKENS           tokens per routing/hash block (duet.hashing): the gateway's fallback block size
    PAGED, PREFIX, SIM          engine kinds; ENGINE_KINDS serve models, WORKER_KINDS `duet engine` starts
    Capability.*                the names workers advertise in GetInfo and requests require
    FinishReason                stop | length | abort (| error, engine-internal), FINISH_TO_PB / FINISH_FROM_PB
    Bound, TEMPERATURE, ...     each sampling setting's default and range

The ranges are enforced twice, from this one table: by the gateway's request models (gateway/api/request_models.py:
a 400 naming the field, and the bounds /openapi.json shows) and by every engine before any work starts
(engine_core/sampling_params.py `SamplingParams.validate`: INVALID_ARGUMENT to a gRPC caller that skipped the
gateway). tests/duet/test_contract.py probes each edge on both sides.

Defaults differ in one place, on purpose: max_tokens. The engine's `SamplingParams()` makes 16 tokens (vLLM's
default, for the offline LLM and in-process callers); the gateway's default is None, "fill the context" (the
room the model's context leaves after the prompt, capped by `--default-max-tokens`), and a GenerateRequest's 0
means the same to an engine (engine_core/servicer.py). top_k has two spellings of "no cut": unset in the engine
and on the wire, 0 (or unset) in the API. A seed may be negative in the API (a signed 64-bit seed, as some
clients send); the gateway wraps it into the engine's [0, 2**64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from duet.rpc import engine_pb2 as pb

# -- routing --------------------------------------------------------------------------------
# Tokens per hashed block of a prompt (duet.hashing.block_hashes). engine_prefix hashes its KV events at this
# size; engine_paged and the sim worker hash at their page size (16 by default, so the same); the gateway uses
# what a worker reports in GetInfo (hash_block_size, else page_size) and this when a model has no worker yet;
# the fleet simulator routes with it.
HASH_BLOCK_TOKENS = 16
# Tokens per block of a Mooncake trace record's `hash_ids` (one id per block, chained): what the gateway's traffic
# capture writes (gateway/control/capture.py) and the trace readers rebuild prompts from (loadtests/traces/).
TRACE_BLOCK_TOKENS = 512

# -- engine kinds ---------------------------------------------------------------------------
PAGED = "paged"  # engine_paged: paged KV, continuous batching, automatic prefix caching
PREFIX = "prefix"  # engine_prefix: radix cache, cache-aware scheduling, structured output, speculation
SIM = "sim"  # duet/sim_worker.py: model-free, poses as PAGED or PREFIX in GetInfo
ENGINE_KINDS = (PAGED, PREFIX)  # what GetInfo reports, routing chooses between and the pools are made of
WORKER_KINDS = (PAGED, PREFIX, SIM)  # what `duet engine KIND` and the launcher start


# -- capabilities ---------------------------------------------------------------------------
class Capability:
    """The names a worker lists in GetInfo `capabilities`; a request requires some of them
    (gateway/api/protocol.py `ApiRequest.required_capabilities`); routing sends it only to workers that have them."""

    N = "n"  # several samples of one prompt
    BEAM_SEARCH = "beam_search"
    LOGPROBS = "logprobs"
    STRUCTURED_OUTPUT = "structured_output"  # json_schema / json_object / regex (and tool calls)
    SPECULATIVE = "speculative"


# what only one kind does: a request needing one from each set can never be served (a 400, not a 503)
PAGED_CAPABILITIES = frozenset({Capability.N, Capability.BEAM_SEARCH})
PREFIX_CAPABILITIES = frozenset({Capability.STRUCTURED_OUTPUT, Capability.SPECULATIVE})
# everything each kind can advertise (engine_prefix lists structured_output only with a tokenizer.json and
# speculative only when drafting); the sim worker poses with these
KIND_CAPABILITIES = {
    PAGED: (Capability.N, Capability.BEAM_SEARCH, Capability.LOGPROBS),
    PREFIX: (Capability.LOGPROBS, Capability.STRUCTURED_OUTPUT, Capability.SPECULATIVE),
}


# -- finish reasons -------------------------------------------------------------------------
class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token id (the gateway also ends a choice with "stop" at a stop string)
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client gone, Abort RPC, or drain timeout
    ERROR = "error"  # the engine failed it (StepOutput.error says why): never on the wire, an error status


FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {number: reason.value for reason, number in FINISH_TO_PB.items()}  # UNSPECIFIED: not done


# -- sampling settings ----------------------------------------------------------------------
@dataclass(frozen=True)
class Bound:
    """One numeric setting: its default and its closed range [lo, hi]; None on a side means unbounded there.
    A value must be a finite number (an int where `integer`; never a bool). A float edge must survive the wire's
    float32 on its own side (float32(lo) >= lo, float32(hi) <= hi), so that what the gateway accepts still
    passes the engine's check after the trip."""

    name: str
    default: float | int | None
    lo: float | None = None
    hi: float | None = None
    integer: bool = False

    def admits(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(value):  # (an int is finite; a huge one overflows a float)
            return False
        if self.lo is not None and value < self.lo:
            return False
        return self.hi is None or value <= self.hi

    @property
    def interval(self) -> str:
        """The range as an error message says it: "[0, 2]", ">= 1", "finite"."""
        if self.lo is None and self.hi is None:
            return "finite"
        if self.hi is None:
            return f">= {_shown(self.lo)}"
        return f"[{_shown(self.lo)}, {_shown(self.hi)}]"

    def field_bounds(self) -> dict:
        """The pydantic Field keywords of this range (which /openapi.json shows as minimum/maximum)."""
        out = {}
        if self.lo is not None:
            out["ge"] = self.lo
        if self.hi is not None:
            out["le"] = self.hi
        return out


def _shown(x: float) -> str:
    if isinstance(x, int) and x >= 1 << 20:  # 2**64 - 1 reads better than its 20 digits
        if x & (x + 1) == 0:
            return f"2**{x.bit_length()} - 1"
        if x & (x - 1) == 0:
            return f"2**{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


INT31 = 1 << 31
MAX_TOKENS = Bound("max_tokens", 16, 1, INT31, integer=True)  # the engine's default; see the docstring
MIN_TOKENS = Bound("min_tokens", 0, 0, INT31, integer=True)  # the engine also needs it <= max_tokens
TEMPERATURE = Bound("temperature", 1.0, 0.0, 2.0)  # 0: greedy
# 1: no cut. Above 0 (no token at all) by a margin the wire's float32 keeps (1e-50 would arrive as 0): 2**-30
TOP_P = Bound("top_p", 1.0, 2.0**-30, 1.0)
TOP_K = Bound("top_k", None, 1, 1 << 20, integer=True)  # None: no cut (the API's 0 too)
MIN_P = Bound("min_p", 0.0, 0.0, 1.0)  # 0: no cut
PRESENCE_PENALTY = Bound("presence_penalty", 0.0, -2.0, 2.0)
FREQUENCY_PENALTY = Bound("frequency_penalty", 0.0, -2.0, 2.0)
REPETITION_PENALTY = Bound("repetition_penalty", 1.0, 0.001, 10.0)  # 1: none
SEED = Bound("seed", None, 0, (1 << 64) - 1, integer=True)  # None: a fresh random stream
SEED_API_LOWEST = -(1 << 63)  # the API also takes a signed 64-bit seed, wrapped into SEED's range
LOGPROBS = Bound("logprobs", None, 0, 20, integer=True)  # alternatives per token: logprobs, top_logprobs,
PROMPT_LOGPROBS = Bound("prompt_logprobs", None, LOGPROBS.lo, LOGPROBS.hi, integer=True)  # and per prompt token
LOGIT_BIAS = Bound("logit_bias", 0.0, -100.0, 100.0)  # added to a token's logit
N = Bound("n", 1, 1, 64, integer=True)  # samples per prompt
BEAM_WIDTH = Bound("beam_width", 1, 1, 64, integer=True)  # 1: no beam search (the API's best_of)
LENGTH_PENALTY = Bound("length_penalty", 1.0)  # beam score = cumulative logprob / length ** length_penalty

MAX_STOP_STRINGS = 16  # stop strings per request (the gateway matches them; engines see only stop token ids)
MAX_LOGIT_BIAS_TOKENS = 1024  # logit_bias entries per request
