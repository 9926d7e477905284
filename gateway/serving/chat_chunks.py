"""The OpenAI chat and text completion answers of one run, rendered from its events
(gateway/serving/events.py): the chunks (`chat.completion.chunk`, `text_completion`) and SSE stream, and
the whole `chat.completion` / `text_completion` object. (The Responses API is gateway/api/responses.py.)

`ChunkBuilder` knows nothing about routing or HTTP; `stream(run, builder)` is the SSE body of a streamed
answer. (An OpenAI chat stream with tools sends no chunk for logprobs alone: they ride on its next chunk.)
A message that is only text, most of a stream, is rendered from a per-choice template of its chunk's bytes
(`ChunkBuilder.text_sse`): the same bytes, only the text encoded per token.
"""

from __future__ import annotations

import contextlib
import json
import time

from gateway import errors
from gateway.serving import prompt_logprobs
from gateway.serving.events import Arguments, CallStart, Content, Event, Finish, TokenLogprob, Usage, answer
from gateway.serving.runs import Run
from gateway.serving.tool_calls import openai_calls


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
_PLACEHOLDER = "\x00duet-text\x00"  # ChunkBuilder.text_sse's template cuts its chunk here
_PLACEHOLDER_JSON = json.dumps(_PLACEHOLDER).encode()


def usage_dict(usage: Usage) -> dict:
    p, c = usage.prompt_tokens, usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


_LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")  # a completion's `logprobs`


class ChunkBuilder:
    def __init__(self, run: Run, index_offset: int = 0) -> None:
        prep = self.prep = run.prep
        self.index_offset = index_offset  # choice indexes of this prompt start here (a completions batch)
        self.chat = prep.api.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + prep.request_id
        self.created = int(time.time())
        self.model = prep.model.model_id
        self.want_logprobs = prep.api.sampling.logprobs
        self.echo = not self.chat and prep.api.echo
        # text_offset counts characters of the returned text, which starts with the prompt when echoed
        self._offsets = [len(prep.prompt_text) if self.echo else 0] * prep.api.sampling.n
        self.prompt_lps = run.prompt_logprobs  # the engine's, for echo and `prompt_logprobs`
        self.tools = prep.api.tools is not None and prep.api.tools.active
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}  # choice -> a text chunk's SSE around its text

    # -- logprobs -----------------------------------------------------------------------------
    @staticmethod
    def _chat_logprobs(lps: tuple[TokenLogprob, ...]) -> list[dict]:
        return [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}
                for lp in lps]

    @staticmethod
    def _completion_logprobs(lps: tuple[TokenLogprob, ...], offset: int) -> tuple[dict, int]:
        """The legacy shape of `lps`, whose text starts at `offset` of the returned text; and where it ends."""
        offsets = []
        for lp in lps:
            offsets.append(offset)
            offset += len(lp.token)
        return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [prompt_logprobs.top_map(lp.top) for lp in lps], "text_offset": offsets}, offset

    def _logprobs(self, lps: tuple[TokenLogprob, ...], choice: int):
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": self._chat_logprobs(lps)}
        out, self._offsets[choice] = self._completion_logprobs(lps, self._offsets[choice])
        return out

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            obj["usage"] = usage
        return obj

    def _prompt_fields(self) -> dict:
        if self.prep.api.sampling.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs.vllm(self.prep.model.tokenizer, self.prep.prompt_ids,
                                                        self.prompt_lps)}

    def _echo_logprobs(self) -> dict | None:
        if not self.want_logprobs:
            return None
        return prompt_logprobs.legacy(self.prep.model.tokenizer, self.prep.prompt_ids, self.prompt_lps,
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

    def chunks(self, events: list[Event]) -> list[dict]:
        """The chunks of one engine message's events: none while nothing is visible yet (an incomplete
        character, a held-back stop prefix), several when a tool call starts in it. The message's
        logprobs go on its first chunk, its finish reason on its last."""
        if not events:
            return []
        choice = events[0].choice
        lps = tuple(lp for e in events if isinstance(e, Content) for lp in e.logprobs)
        finish = next((e.reason for e in events if isinstance(e, Finish)), None)
        text = "".join(e.text for e in events if isinstance(e, Content))
        if not self.chat:
            return [self._chunk([{"index": choice + self.index_offset, "text": text,
                                  "logprobs": self._logprobs(lps, choice), "finish_reason": finish}],
                                with_usage=self.prep.api.include_usage)]
        deltas = [d for d in map(_delta, events) if d is not None]
        if not deltas and (finish is not None or (lps and not self.tools)):
            deltas = [{}]
        logprobs = self._logprobs(lps, choice) if lps or not self.tools else None
        return [self._chunk([{"index": choice + self.index_offset, "delta": delta,
                              "logprobs": logprobs if i == 0 else None,
                              "finish_reason": finish if i == len(deltas) - 1 else None}],
                            with_usage=self.prep.api.include_usage)
                for i, delta in enumerate(deltas)]

    def text_sse(self, events: list[Event]) -> bytes | None:
        """The SSE bytes of a message that is one choice's text and nothing else (no logprobs, no tool calls, no
        finish): most tokens of most streams. The chunk is the same every time but for its text, so its bytes are
        a template cut once per choice around a placeholder, and only the text is encoded per token: the same
        bytes as `sse(self.chunks(events)[0])` (tests/gateway/test_chat_chunks.py) without building and encoding
        the whole chunk. None: render it the general way."""
        if len(events) != 1 or self.want_logprobs or self.tools:
            return None
        e = events[0]
        if type(e) is not Content or not e.text:
            return None
        template = self._templates.get(e.choice, False)
        if template is False:
            template = self._templates[e.choice] = self._template(e.choice)
        if template is None:
            return None
        return template[0] + json.dumps(e.text, ensure_ascii=False).encode() + template[1]

    def _template(self, choice: int) -> tuple[bytes, bytes] | None:
        (chunk,) = self.chunks([Content(_PLACEHOLDER, choice)])
        before, found, after = sse(chunk).partition(_PLACEHOLDER_JSON)
        # the placeholder once, in the text: no other field (the model's name) holds it
        return (before, after) if found and _PLACEHOLDER_JSON not in after else None

    def usage_chunk(self, usage: Usage) -> dict:
        return self._chunk([], usage_dict(usage), with_usage=True)

    # -- whole response -----------------------------------------------------------------------
    def choices(self, events: list[Event]) -> list[dict]:
        out = []
        for i in range(self.prep.api.sampling.n):
            a = answer(events, i)
            finish = a.finish.reason if a.finish is not None else None
            if self.chat:
                message = {"role": "assistant", "content": (a.text or None) if a.calls else a.text,
                           **({"tool_calls": openai_calls(a.calls)} if a.calls else {})}
                lp = {"content": self._chat_logprobs(a.logprobs)} if self.want_logprobs else None
                out.append({"index": i + self.index_offset, "message": message, "logprobs": lp,
                            "finish_reason": finish})
            else:
                lp = None
                if self.want_logprobs:
                    parts = ([self._echo_logprobs()] if self.echo else [])
                    parts.append(self._completion_logprobs(a.logprobs, len(self.prep.prompt_text) if self.echo
                                                           else 0)[0])
                    lp = {k: [v for part in parts for v in part[k]] for k in _LEGACY_KEYS}
                text = self.prep.prompt_text + a.text if self.echo else a.text
                out.append({"index": i + self.index_offset, "text": text, "logprobs": lp,
                            "finish_reason": finish, **self._prompt_fields()})
        return out

    def whole(self, choices: list[dict], usage: Usage) -> dict:
        whole = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices, "usage": usage_dict(usage)}
        if self.chat:
            whole.update(self._prompt_fields())  # vLLM puts a chat's prompt logprobs beside the choices
        return whole


def _delta(e: Event) -> dict | None:
    """A chat chunk's `delta` for one event (None: the event has no delta of its own)."""
    if isinstance(e, Content):
        return {"content": e.text} if e.text else None
    if isinstance(e, CallStart):
        return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}]}
    if isinstance(e, Arguments):
        return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
    return None


async def stream(run: Run, builder: ChunkBuilder, last: bool = True):
    """SSE bytes of a run's answer. Events produced together go out in one write (role + first token; the
    last token + usage + [DONE]): fewer syscalls per request, same bytes. `last` False (one prompt of a
    batch) leaves the usage chunk and [DONE] to the caller."""
    error: errors.GatewayError | None = None
    out = [sse(chunk) for chunk in builder.opening_chunks()]
    finished, n = 0, run.prep.api.sampling.n
    try:
        async with contextlib.aclosing(run.events()) as steps:
            async for events in steps:
                text = builder.text_sse(events)
                if text is not None:
                    out.append(text)
                else:
                    out.extend(sse(chunk) for chunk in builder.chunks(events))
                finished += sum(isinstance(e, Finish) for e in events)
                if out and finished < n:  # the very last event waits for the end
                    yield b"".join(out)
                    out = []
        if run.prep.api.include_usage and last:
            out.append(sse(builder.usage_chunk(run.usage)))
    except errors.GatewayError as e:
        error = e
    if error is not None:
        out.append(sse(errors.error_payload(error)))
    if last:
        out.append(SSE_DONE)
    if out:
        yield b"".join(out)
