"""One dispatched generation until its last byte (`Run`): per-token timing metrics, the request
stats, releasing its admission slot, and cancelling the engine call when the client goes.

    chunk_groups()  the chat/completion chunks as the engine produces them
    steps()         the same as text and tool-call pieces (what gateway/api/responses.py and
                    messages.py translate into their events)
    stream()        SSE bytes of those chunks
    collect()       the whole JSON answer (`collect(runs, ...)` merges several: a completions batch)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors
from gateway.serving.chat_chunks import SSE_DONE, ChunkBuilder, sse
from gateway.serving.context import ServingContext
from gateway.serving.generation import Dispatched, Prepared, outputs
from gateway.serving.mirror import Tap
from gateway.serving.request_class import request_class

log = logging.getLogger("duet.gateway.api")


class Step(NamedTuple):
    pieces: list[tuple[str, ...]]  # ("text", text) | ("call", id, name) | ("arguments", more of the open call's)
    finish_reason: str | None  # the chat path's: stop | length | tool_calls
    stop_sequence: str | None  # the stop string that ended the answer


class Run:
    """One dispatched request until its last byte: timing metrics, stats, release, cancel."""

    def __init__(self, ctx: ServingContext, prep: Prepared, d: Dispatched, endpoint: str,
                 index_offset: int = 0, tap: Tap | None = None) -> None:
        self.ctx, self.prep, self.d, self.endpoint = ctx, prep, d, endpoint
        self.tap = tap  # a shadow copy of this request is in flight: it reads this answer (gateway/serving/mirror.py)
        self.builder = ChunkBuilder(prep, index_offset)
        self.builder.prompt_lps = list(d.first.prompt_logprobs) if prep.api.sampling.prompt_logprobs is not None \
            else None
        self.usage: dict = {}
        dec = d.decision
        self.labels = (prep.model.model_id, dec.engine_kind, dec.variant,
                       request_class(prep.api, prep.session_key, len(prep.prompt_ids)))
        self._itl = ctx.metrics.itl.labels(*self.labels)  # resolved once, observed per token
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.itls: list[float] = []

    def _tick(self, delta) -> None:
        if not delta.token_ids:
            return
        if self.tap is not None:
            self.tap.primary_token_ids(delta.token_ids)
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
            self.ctx.metrics.ttft.labels(*self.labels).observe(now - self.prep.arrival)
        else:
            itl = (now - self.last_at) / len(delta.token_ids)
            self.itls.append(itl)
            self._itl.observe(itl)
        self.last_at = now

    def finish(self, status: str) -> None:
        ctx, dec = self.ctx, self.d.decision
        self.d.close()
        ctx.pending.release()
        ctx.metrics.requests.labels(self.endpoint, status).inc()
        ok = status == "200"
        if ok:
            ctx.metrics.e2e.labels(*self.labels).observe(time.perf_counter() - self.prep.arrival)
            m = self.labels[0]
            ctx.metrics.prompt_tokens.labels(m).inc(self.usage.get("prompt_tokens", 0))
            ctx.metrics.cached_tokens.labels(m, dec.engine_kind).inc(self.usage.get("cached_tokens", 0))
            ctx.metrics.generation_tokens.labels(m).inc(self.usage.get("completion_tokens", 0))
            prompt = self.usage.get("prompt_tokens", 0) or len(self.prep.prompt_ids)
            ctx.pool_tracker.finished(time.monotonic(), dec, ctx.router.block_size(m), prompt,
                                      self.usage.get("cached_tokens", 0), self.usage.get("completion_tokens", 0))
        ttft_s = None if self.first_at is None else self.first_at - self.prep.arrival
        itl_s = sum(self.itls) / len(self.itls) if self.itls else None
        ctx.stats.record(
            model=self.labels[0], ok=ok or status == "499", engine_kind=dec.engine_kind, variant=dec.variant,
            worker_id=dec.worker_id, reason=dec.reason, ttft_s=ttft_s, itl_s=itl_s,
            output_tokens=self.usage.get("completion_tokens", 0),
        )
        if self.tap is not None:
            self.tap.primary_finished(status, ttft_s, itl_s)

    async def chunk_groups(self, last: bool = True):
        """(delta, chunk dicts) as the engine produces them: the opening chunks first (delta None), the
        usage chunk last when asked for and `last`. A failure mid-stream is counted and re-raised; the run
        is finished however the iteration ends (the other APIs translate these chunks into their events)."""
        status = "499"  # until proven otherwise: the client went away
        try:
            yield None, self.builder.opening_chunks()
            async for delta in outputs(self.prep, self.d, self.usage):
                self._tick(delta)
                yield delta, self.builder.chunks(delta)
            if self.prep.api.include_usage and last:
                yield None, [self.builder.usage_chunk(self.usage)]
            status = "200"
        except errors.GatewayError as e:
            status = str(e.status)
            self.ctx.metrics.stream_errors.labels(self.d.decision.worker_id).inc()
            log.warning("request %s: %s", self.prep.request_id, e.message)
            raise
        finally:
            if status == "499":
                self.ctx.metrics.cancelled.inc()
            self.finish(status)

    async def steps(self):
        """The answer as content and tool-call pieces, one `Step` per engine message (what the other APIs'
        streams translate into their events). Use it under `contextlib.aclosing`, which finishes the run
        on any exit; a failure mid-stream is raised (GatewayError)."""
        async with contextlib.aclosing(self.chunk_groups()) as groups:
            async for delta, chunks in groups:
                step = Step([], None, delta.stop_sequence if delta is not None and delta.finish_reason else None)
                for choice in (c for chunk in chunks for c in chunk["choices"]):
                    d = choice["delta"]
                    if d.get("content"):
                        step.pieces.append(("text", d["content"]))
                    for tc in d.get("tool_calls") or ():  # (the chat path's tool-call parser made these)
                        if "id" in tc:
                            step.pieces.append(("call", tc["id"], tc["function"]["name"]))
                        elif tc["function"].get("arguments"):
                            step.pieces.append(("arguments", tc["function"]["arguments"]))
                    step = step._replace(finish_reason=choice.get("finish_reason") or step.finish_reason)
                yield step

    async def stream(self, last: bool = True):
        """SSE bytes. Events produced together go out in one write (role + first token; the last
        token + usage + [DONE]): fewer syscalls per request, same bytes. `last` False (one prompt of a
        batch) leaves the usage chunk and [DONE] to the caller."""
        error: errors.GatewayError | None = None
        out: list[bytes] = []
        finished, n = 0, self.prep.api.sampling.n
        try:
            async with contextlib.aclosing(self.chunk_groups(last)) as groups:
                async for delta, chunks in groups:
                    out.extend(sse(chunk) for chunk in chunks)
                    finished += delta is not None and delta.finish_reason is not None
                    if out and delta is not None and finished < n:  # the very last event waits for the end
                        yield b"".join(out)
                        out = []
        except errors.GatewayError as e:
            error = e
        if error is not None:
            out.append(sse(errors.error_payload(error)))
        if last:
            out.append(SSE_DONE)
        if out:
            yield b"".join(out)

    async def gather(self) -> None:
        async for delta in outputs(self.prep, self.d, self.usage):
            self._tick(delta)
            self.builder.add(delta)

    async def collect(self, request: Request, headers: dict, shape=None, render_error=errors.error_response
                      ) -> Response:
        """The whole response; a client that disconnects meanwhile cancels the engine call. `shape`
        (async) turns the chat/completion object into another API's, `render_error` an error into its
        error shape."""
        async def whole() -> dict:
            obj = self.builder.whole(self.usage)
            return await shape(obj) if shape else obj

        return await collect([self], disconnected(request), headers, whole, render_error)


async def collect(runs: list[Run], gone, headers: dict, whole, render_error=errors.error_response) -> Response:
    """Gather every run, then answer `await whole()`; `gone` (a coroutine) finishing first means the
    client left, which cancels the engine calls. A failure is the answer (`render_error`); the other
    runs are stopped. Every run is finished however it ends."""
    work = asyncio.ensure_future(asyncio.gather(*(r.gather() for r in runs)))
    watcher = asyncio.ensure_future(gone)
    status = "499"
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return Response(status_code=499)
        try:
            work.result()
        except errors.GatewayError as e:
            status = str(e.status)
            return render_error(e, headers)
        status = "200"
        return JSONResponse(await whole(), headers=headers)
    finally:
        watcher.cancel()
        work.cancel()  # after a failure (or a client gone) the other runs may still be reading: stop them
        for r in runs:
            if status == "499":
                r.ctx.metrics.cancelled.inc()
            r.finish(status)


async def disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
