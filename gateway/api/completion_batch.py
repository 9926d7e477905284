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

from gateway.serving.chat_chunks import SSE_DONE, ChunkBuilder, sse
from gateway.serving.chat_chunks import stream as run_stream
from gateway.serving.events import Usage
from gateway.serving.runs import collect as run_all


def _usage(runs) -> Usage:
    return Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in runs),
                 completion_tokens=sum(r.usage.completion_tokens for r in runs),
                 cached_tokens=sum(r.usage.cached_tokens for r in runs))


def _builders(runs) -> list[ChunkBuilder]:
    n = runs[0].prep.api.sampling.n
    return [ChunkBuilder(r, index_offset=i * n) for i, r in enumerate(runs)]


async def stream(runs):
    """SSE bytes of every run as they arrive, then one usage chunk (when asked for) and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()
    builders = _builders(runs)

    async def pump(run, builder) -> None:
        try:
            async for part in run_stream(run, builder, last=False):
                await queue.put(part)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(r, b)) for r, b in zip(runs, builders)]
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
            tail.append(sse(builders[0].usage_chunk(_usage(runs))))
        yield b"".join([*tail, SSE_DONE])
    finally:
        for t in tasks:  # the client went away: every engine call is cancelled
            t.cancel()


async def collect(runs, headers: dict, gone) -> Response:
    """The whole response of every run; `gone` (a coroutine) finishing first means the client left."""
    builders = _builders(runs)

    async def whole(events: list) -> dict:
        return builders[0].whole([c for b, e in zip(builders, events) for c in b.choices(e)], _usage(runs))

    return await run_all(runs, gone, headers, whole)
