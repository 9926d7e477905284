"""A list of prompts in one `/v1/completions` request: one response with one choice per prompt.

Each prompt is its own engine call (gateway/api.py admits, prepares and dispatches each, so every
prompt is routed by its own prefix), with its choices numbered `prompt_index * n + j` as OpenAI and
vLLM number them. Here the runs' answers are merged: streamed chunks interleave as they come (each
carries its choice index), a whole response lists the choices in index order, and usage is the sum.
A run that fails ends the merged stream with its error event; in a whole response the first
failure is the answer.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse, Response

from gateway import errors
from gateway.responses import SSE_DONE, sse, usage_dict

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
    work = asyncio.ensure_future(asyncio.gather(*(r.gather() for r in runs)))
    watcher = asyncio.ensure_future(gone)
    status = "499"
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            return Response(status_code=499)
        try:
            work.result()
        except errors.GatewayError as e:
            status = str(e.status)
            return errors.error_response(e, headers)
        status = "200"
        usage = _usage(runs)
        whole = runs[0].builder.whole(usage)
        whole["choices"] = [c for r in runs for c in r.builder.whole(r.usage)["choices"]]
        whole["usage"] = usage_dict(usage)
        return JSONResponse(whole, headers=headers)
    finally:
        watcher.cancel()
        work.cancel()  # after a failure the other runs may still be reading: stop them
        for r in runs:
            if status == "499":
                r.gw.metrics.cancelled.inc()
            r.finish(status)
