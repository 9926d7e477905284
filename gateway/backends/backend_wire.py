"""Duet's Generate contract in the words of external servers (gateway/backends/http_backend.py sends them).

The gateway tokenizes, detokenizes and matches stop strings itself, so what crosses the wire is the
same as to Duet's own engines: prompt token ids and sampling parameters out, token ids back.

- vLLM (`vllm serve --enable-scale-out`): `POST /inference/v1/generate` takes `token_ids`,
  `sampling_params` (vLLM's SamplingParams as JSON; structured output under `structured_outputs`),
  `cache_salt`, `priority` and `stream`; it streams SSE chunks of `choices[{index, token_ids,
  finish_reason, logprobs: {content: [{token_id, logprob, top_logprobs}]}}]`, then one chunk with
  `usage` (its `prompt_tokens_details.cached_tokens` with `--enable-prompt-tokens-details`), then
  `[DONE]`. An error mid-stream is a chunk `{"error": {...}}`.
- Any other OpenAI server (SGLang, engine `openai`): `POST /v1/completions` with the prompt as a list of
  token ids; the text that comes back is encoded again by the gateway's tokenizer unless the server
  also returns `token_ids` (vLLM's `return_token_ids`), so token boundaries can differ from the
  engine's — the approximate path, documented in docs/operations.md.

Cached tokens come only at the end of a stream, so `ChunkReader` holds back each choice's finishing
message until the usage arrives and sends it with `prompt` set (gateway/serving/generation.py reads a prompt
that comes late).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from duet.rpc import engine_pb2 as pb

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class WireError(Exception):
    """The server answered something Duet cannot use; `retryable` as EngineCallError's."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def vllm_sampling(sp: pb.SamplingParams) -> dict:
    """vLLM SamplingParams (JSON) for Duet's; only what is set, so vLLM's defaults hold for the rest."""
    out: dict = {"max_tokens": sp.max_tokens, "n": max(1, sp.n), "min_tokens": sp.min_tokens,
                 "ignore_eos": sp.ignore_eos, "presence_penalty": sp.presence_penalty,
                 "frequency_penalty": sp.frequency_penalty, "detokenize": False}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if sp.HasField(name):
            out[name] = getattr(sp, name)
    if out["n"] > 1 and out.get("temperature") == 0.0:
        # vLLM refuses n > 1 with greedy sampling; top-k 1 picks the argmax just the same (Duet's engines
        # answer n greedy copies)
        out["temperature"], out["top_k"] = 1.0, 1
    if sp.HasField("seed"):
        out["seed"] = sp.seed % (1 << 63)  # vLLM's seed is a signed 64-bit int
    if sp.HasField("logprobs"):
        out["logprobs"] = sp.logprobs
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    constraint = sp.WhichOneof("constraint")
    if constraint == "json_schema":
        out["structured_outputs"] = {"json": sp.json_schema}
    elif constraint == "json_object":
        out["structured_outputs"] = {"json_object": True}
    elif constraint == "regex":
        out["structured_outputs"] = {"regex": sp.regex}
    return out


def _unsupported(req: pb.GenerateRequest) -> str | None:
    sp = req.sampling
    if sp.beam_width > 1:
        return "beam search is not served by external backends"
    if sp.HasField("prompt_logprobs"):
        return "prompt_logprobs is not served by external backends"
    return None


def vllm_generate_body(req: pb.GenerateRequest) -> dict:
    if (why := _unsupported(req)) is not None:
        raise WireError(why, retryable=False)
    body = {"request_id": req.request_id, "token_ids": list(req.prompt_token_ids),
            "sampling_params": vllm_sampling(req.sampling), "stream": True,
            "stream_options": {"include_usage": True}}
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    if req.priority:  # vLLM refuses any priority but 0 unless it runs priority scheduling
        body["priority"] = req.priority
    return body


def completions_body(req: pb.GenerateRequest, model: str) -> dict:
    if (why := _unsupported(req)) is not None:
        raise WireError(why, retryable=False)
    sp = vllm_sampling(req.sampling)
    sp.pop("detokenize")
    sp.pop("logprobs", None)  # text-keyed logprobs cannot be mapped back to token ids
    constraint = sp.pop("structured_outputs", None) or {}
    body = {"model": model, "prompt": list(req.prompt_token_ids), "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, **sp}
    if "json" in constraint:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": json.loads(constraint["json"])}}
    elif constraint.get("json_object"):
        body["response_format"] = {"type": "json_object"}
    elif "regex" in constraint:
        body["regex"] = constraint["regex"]  # SGLang's and vLLM's extension
    return body


def _logprobs(raw, limit: int) -> list[pb.TokenLogprob]:
    out = []
    for entry in (raw or {}).get("content") or ():
        tops = [pb.TopLogprob(token_id=t["token_id"], logprob=t["logprob"])
                for t in (entry.get("top_logprobs") or ())[:limit]]
        out.append(pb.TokenLogprob(token_id=entry["token_id"], logprob=entry["logprob"], top=tops))
    return out


class ChunkReader:
    """SSE chunks (parsed JSON) of one stream -> pb.GenerateResponse messages (module doc)."""

    def __init__(self, num_prompt_tokens: int, top_logprobs: int = 0,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.top_logprobs = top_logprobs
        self.encode = encode  # the approximate path: text -> ids when the server sends no token ids
        self.held: list[pb.GenerateResponse] = []  # finishing messages, waiting for the usage
        self.cached_tokens = 0
        self.sent_any = False

    def push(self, chunk: dict) -> list[pb.GenerateResponse]:
        if not isinstance(chunk, dict):
            raise WireError(f"unexpected stream chunk {chunk!r:.200}")
        if "error" in chunk or chunk.get("object") == "error":
            err = chunk.get("error", chunk)
            message = err.get("message", err) if isinstance(err, dict) else err
            raise WireError(f"the backend failed mid-stream: {message}")
        usage = chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.cached_tokens = int(details["cached_tokens"])
        if usage.get("prompt_tokens"):
            self.num_prompt_tokens = int(usage["prompt_tokens"])
        out = []
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is None and self.encode is not None and choice.get("text"):
                ids = self.encode(choice["text"])
            msg = pb.GenerateResponse(index=choice.get("index", 0), token_ids=ids or [],
                                      logprobs=_logprobs(choice.get("logprobs"), self.top_logprobs))
            reason = choice.get("finish_reason")
            if reason is not None:
                msg.finish_reason = _FINISH.get(reason, pb.FINISH_REASON_STOP)
                self.held.append(msg)
                continue
            if msg.token_ids:
                out.append(self._mark(msg))
        return out

    def finish(self) -> list[pb.GenerateResponse]:
        """The stream ended ([DONE]): the held finishing messages, the last one carrying the usage."""
        held, self.held = self.held, []
        if held:
            held[-1].prompt.CopyFrom(pb.PromptInfo(prompt_tokens=self.num_prompt_tokens,
                                                   cached_tokens=self.cached_tokens))
            if not self.sent_any:
                held[0].prompt.CopyFrom(held[-1].prompt)
        return held

    def _mark(self, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        if not self.sent_any:  # the first message says the prompt size (the cache hit comes at the end)
            msg.prompt.CopyFrom(pb.PromptInfo(prompt_tokens=self.num_prompt_tokens))
            self.sent_any = True
        return msg
