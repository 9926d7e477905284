"""The one request every API becomes: `ApiRequest` (with its `Sampling`), what the request path serves.

Chat completions and completions parse into it (gateway/api/protocol.py), and the Responses and Messages APIs
map onto a chat body first, so prepare, dispatch and the run do not care which API a request came
through. `required_capabilities` is what routing must find in a worker (structured output and
speculative decoding on engine_prefix, n > 1 and beam search on engine_paged).
"""

from __future__ import annotations

from dataclasses import dataclass

from duet import contract as c
from duet.contract import Capability
from gateway.serving.tools import ToolRequest


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of either endpoint, with duet/contract.py's defaults; `max_tokens` None means
    "fill the context" (the engine's own default is 16: the contract says why they differ)."""

    max_tokens: int | None = None
    temperature: float = c.TEMPERATURE.default
    top_p: float = c.TOP_P.default
    top_k: int | None = c.TOP_K.default
    min_p: float = c.MIN_P.default
    presence_penalty: float = c.PRESENCE_PENALTY.default
    frequency_penalty: float = c.FREQUENCY_PENALTY.default
    repetition_penalty: float = c.REPETITION_PENALTY.default
    seed: int | None = c.SEED.default
    n: int = c.N.default
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token; 0 with logprobs=True still returns the chosen token's
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = c.MIN_TOKENS.default
    json_object: bool = False
    json_schema: str | None = None
    # vLLM's extra parameters (gateway/api/extra_params.py)
    beam_width: int = c.BEAM_WIDTH.default
    length_penalty: float = c.LENGTH_PENALTY.default
    regex: str | None = None
    speculative: bool | None = None
    priority: int = 0  # lower is admitted first by an engine scheduling by priority
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids checked in prepare()
    # alternatives per prompt token (echo + logprobs, or vLLM's field)
    prompt_logprobs: int | None = c.PROMPT_LOGPROBS.default


@dataclass(frozen=True)
class ApiRequest:
    kind: str  # "chat" | "completion"
    model: str
    sampling: Sampling
    messages: tuple[dict, ...] = ()
    tools: ToolRequest | None = None
    prompt: str | tuple[int, ...] = ""
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    echo: bool = False

    @property
    def turn_count(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "user") or 1

    @property
    def required_capabilities(self) -> frozenset[str]:
        s = self.sampling
        caps = set()
        if s.n > 1 and s.beam_width == 1:
            caps.add(Capability.N)
        if s.beam_width > 1:
            caps.add(Capability.BEAM_SEARCH)
        if s.json_object or s.json_schema is not None or s.regex is not None or (self.tools and self.tools.active):
            caps.add(Capability.STRUCTURED_OUTPUT)  # tool requests route like structured output
        if s.speculative:
            caps.add(Capability.SPECULATIVE)
        return frozenset(caps)
