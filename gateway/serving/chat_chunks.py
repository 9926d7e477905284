"""The chat and text completion chunks (`chat.completion.chunk`, `text_completion`) of one run, and its
whole `chat.completion` / `text_completion` object. (The Responses API is gateway/api/responses.py.)

`ChunkBuilder` turns the generation path's `Delta`s into the dicts the OpenAI SDK expects;
it knows nothing about routing or HTTP.
"""

from __future__ import annotations

import json
import time

from gateway.serving import prompt_logprobs
from gateway.serving.generation import Delta, Prepared
from gateway.serving.tool_calls import Arguments, CallStart, Content, ToolCallParser, parse_whole


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage_dict(usage: dict) -> dict:
    p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}


class ChunkBuilder:
    def __init__(self, prep: Prepared, index_offset: int = 0) -> None:
        self.prep = prep
        self.index_offset = index_offset  # choice indexes of this prompt start here (a completions batch)
        self.chat = prep.api.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + prep.request_id
        self.created = int(time.time())
        self.model = prep.model.model_id
        self.want_logprobs = prep.api.sampling.logprobs
        n = prep.api.sampling.n
        self._texts = [[] for _ in range(n)]
        self._lp_parts = [[] for _ in range(n)]
        self._finish: list[str | None] = [None] * n
        self.stop_sequences: list[str | None] = [None] * n  # which stop string ended each choice
        self.echo = not self.chat and prep.api.echo
        # text_offset counts characters of the returned text, which starts with the prompt when echoed
        self._offsets = [len(prep.prompt_text) if self.echo else 0] * n
        self.prompt_lps = None  # the engine's prompt logprobs (set by the caller from the first message)
        tools = prep.api.tools
        self.tool_mode = None
        if self.chat and tools is not None and tools.active:
            self.tool_mode = ("function" if tools.choice == "function" else tools.choice, tools.function)
        self._parsers = [ToolCallParser(*self.tool_mode) for _ in range(n)] if self.tool_mode else None

    # -- logprobs -----------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.prep.model.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, d: Delta) -> list[dict]:
        out = []
        for lp in d.logprobs:
            tok = self._token(lp.token_id)
            top = [{"token": (t := self._token(a.token_id)), "logprob": a.logprob, "bytes": list(t.encode())}
                   for a in lp.top[: self.prep.api.sampling.top_logprobs]]
            out.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()), "top_logprobs": top})
        return out

    def _completion_logprobs(self, d: Delta) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for lp in d.logprobs:
            tok = self._token(lp.token_id)
            offsets.append(self._offsets[d.index])
            self._offsets[d.index] += len(tok)
            tokens.append(tok)
            lps.append(lp.logprob)
            tops.append(prompt_logprobs.top_map(self.prep.model.tokenizer, lp.top[: self.prep.api.sampling.top_logprobs]))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, d: Delta):
        if not self.want_logprobs:
            return None
        return {"content": self._chat_logprobs(d)} if self.chat else self._completion_logprobs(d)

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            obj["usage"] = usage
        return obj

    def _prompt_fields(self) -> dict:
        if self.prompt_lps is None or self.prep.api.sampling.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs.vllm(self.prep.model.tokenizer, self.prep.prompt_ids,
                                                        self.prompt_lps)}

    def _echo_logprobs(self) -> dict | None:
        if not self.want_logprobs:
            return None
        return prompt_logprobs.legacy(self.prep.model.tokenizer, self.prep.prompt_ids, self.prompt_lps or [],
                                      self.prep.api.sampling.top_logprobs)

    def opening_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role (as OpenAI does); an echoed completion
        opens with the prompt (and its logprobs)."""
        if self.echo:
            return [self._chunk([{"index": i, "text": self.prep.prompt_text, "logprobs": self._echo_logprobs(),
                                  "finish_reason": None, **self._prompt_fields()}],
                                with_usage=self.prep.api.include_usage)
                    for i in range(self.index_offset, self.index_offset + self.prep.api.sampling.n)]
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], with_usage=self.prep.api.include_usage)
                for i in range(self.index_offset, self.index_offset + self.prep.api.sampling.n)]

    def chunks(self, d: Delta) -> list[dict]:
        """The chunks one delta makes: none while nothing is visible yet (an incomplete character, a
        held-back stop prefix), several when a tool call starts in it."""
        if self._parsers is not None:
            return self._tool_chunks(d)
        if not d.text and d.finish_reason is None and not (self.want_logprobs and d.logprobs):
            return []
        if self.chat:
            choice = {"index": d.index + self.index_offset, "delta": {"content": d.text} if d.text else {},
                      "logprobs": self._logprobs(d), "finish_reason": d.finish_reason}
        else:
            choice = {"index": d.index + self.index_offset, "text": d.text, "logprobs": self._logprobs(d),
                      "finish_reason": d.finish_reason}
        return [self._chunk([choice], with_usage=self.prep.api.include_usage)]

    def _finish_reason(self, reason: str | None, calls: int) -> str | None:
        return "tool_calls" if reason == "stop" and calls else reason

    def _tool_chunks(self, d: Delta) -> list[dict]:
        parser = self._parsers[d.index]
        events = parser.feed(d.text) + (parser.finish() if d.finish_reason is not None else [])
        deltas = []
        for e in events:
            if isinstance(e, Content):
                deltas.append({"content": e.text})
            elif isinstance(e, CallStart):
                deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                               "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, Arguments):
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        if d.finish_reason is not None and not deltas:
            deltas.append({})
        logprobs = self._logprobs(d) if d.logprobs else None
        out = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = {"index": d.index + self.index_offset, "delta": delta, "logprobs": logprobs if i == 0 else None,
                      "finish_reason": self._finish_reason(d.finish_reason, parser.calls) if last else None}
            out.append(self._chunk([choice], with_usage=self.prep.api.include_usage))
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return self._chunk([], usage_dict(usage), with_usage=True)

    # -- whole response -----------------------------------------------------------------------
    def add(self, d: Delta) -> None:
        self._texts[d.index].append(d.text)
        if self.want_logprobs:
            self._lp_parts[d.index].append(self._logprobs(d))
        if d.finish_reason is not None:
            self._finish[d.index] = d.finish_reason
            self.stop_sequences[d.index] = d.stop_sequence

    def whole(self, usage: dict) -> dict:
        choices = []
        for i, parts in enumerate(self._texts):
            text = "".join(parts)
            if self.chat:
                lp = ({"content": [c for part in self._lp_parts[i] for c in part["content"]]}
                      if self.want_logprobs else None)
                message, finish = {"role": "assistant", "content": text}, self._finish[i]
                if self.tool_mode:
                    content, calls = parse_whole(text, *self.tool_mode)
                    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                    finish = self._finish_reason(finish, len(calls))
                choices.append({"index": i + self.index_offset, "message": message, "logprobs": lp,
                                "finish_reason": finish})
            else:
                lp = None
                keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                if self.want_logprobs:
                    parts = ([self._echo_logprobs()] if self.echo else []) + self._lp_parts[i]
                    lp = {k: [v for part in parts for v in part[k]] for k in keys}
                if self.echo:
                    text = self.prep.prompt_text + text
                choices.append({"index": i + self.index_offset, "text": text, "logprobs": lp,
                                "finish_reason": self._finish[i], **self._prompt_fields()})
        whole = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices, "usage": usage_dict(usage)}
        if self.chat:
            whole.update(self._prompt_fields())  # vLLM puts a chat's prompt logprobs beside the choices
        return whole
