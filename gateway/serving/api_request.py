"""The one request every API becomes: `ApiRequest` (with its `Sampling`), what the request path serves.

Chat completions and completions parse into it (gateway/api/protocol.py), and the Responses and Messages APIs
map onto a chat body first, so prepare, dispatch and the run do not care which API a request came
through. `required_capabilities` is what routing must find in a worker (structured output and
speculative decoding on engine_prefix, n > 1 and beam search on engine_paged).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.serving.tools import ToolRequest


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of either endpoint; `max_tokens` None means "fill the context"."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token; 0 with logprobs=True still returns the chosen token's
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    json_object: bool = False
    json_schema: str | None = None
    # vLLM's extra parameters (gateway/api/extra_params.py)
    beam_width: int = 1
    length_penalty: float = 1.0
    regex: str | None = None
    speculative: bool | None = None
    priority: int = 0  # lower is scheduled first by an engine scheduling by priority
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); ids checked in prepare()
    prompt_logprobs: int | None = None  # alternatives per prompt token (echo + logprobs, or vLLM's field)


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
            caps.add("n")
        if s.beam_width > 1:
            caps.add("beam_search")
        if s.json_object or s.json_schema is not None or s.regex is not None or (self.tools and self.tools.active):
            caps.add("structured_output")  # tool requests route like structured output
        if s.speculative:
            caps.add("speculative")
        return frozenset(caps)
