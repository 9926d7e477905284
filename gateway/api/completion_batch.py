"""A list of prompts in one `/v1/completions` request: one response with one choice per prompt.

Each prompt is its own engine call (gateway/serving/start.py prepares, admits and dispatches each, so every
prompt is routed by its own prefix), with its choices numbered `prompt_index * n + j` as OpenAI and
vLLM number them. Here the runs' answers are merged: streamed chunks interleave as they come (each
carries its choice index), a whole response lists the choices in index order, and usage is the sum.
A run that fails ends the merged stream with its error event; in a whole response the first
failure is the answer.
"""

from __future__ import annotations

import asyncio

from starlette.responses import Response

from gateway.serving.chat_chunks import SSE_DONE, sse, usage_dict
from gateway.serving.runs import collect as run_all

_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def _usage(runs) -> dict:
    return {k: sum(r.usage.get(k, 0) for r in runs) for k in _KEYS}


async def stream(runs):
    """SSE bytes of every run as they arrive, then one usage chunk (when asked for) and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run) -> None:
        try:
            async for part in run.stream(last=False):
                await queue.put(part)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        open_runs = len(tasks)
        while open_runs:
            part = await queue.get()
            if part is None:
                open_runs -= 1
            else:
                yield part
        tail = []
        if runs[0].prep.api.include_usage:
            tail.append(sse(runs[0].builder.usage_chunk(_usage(runs))))
        yield b"".join([*tail, SSE_DONE])
    finally:
        for t in tasks:  # the client went away: every engine call is cancelled
            t.cancel()


async def collect(runs, headers: dict, gone) -> Response:
    """The whole response of every run; `gone` (a coroutine) finishing first means the client left."""
    async def whole() -> dict:
        usage = _usage(runs)
        merged = runs[0].builder.whole(usage)
        merged["choices"] = [c for r in runs for c in r.builder.whole(r.usage)["choices"]]
        merged["usage"] = usage_dict(usage)
        return merged

    return await run_all(runs, gone, headers, whole)
