"""One dispatched generation until its last byte (`Run`): the typed events every API renders
(gateway/serving/events.py), per-token timing metrics, the request stats, releasing its admission slot,
and cancelling the engine call when the client goes.

    events()   the answer as typed events, one list per engine message (a stream renders each as it comes)
    collect()  every event of one or more runs (a completions batch), then the whole answer the API
               renders from them; a client that leaves meanwhile cancels the engine calls
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors
from gateway.serving.context import ServingContext
from gateway.serving.events import Content, Event, Finish, TokenLogprob, Usage
from gateway.serving.generation import Delta, Dispatched, Prepared, outputs
from gateway.serving.mirror import Tap
from gateway.serving.request_class import request_class
from gateway.serving.tool_calls import ToolCallParser

log = logging.getLogger("duet.gateway.api")


class Run:
    """One dispatched request until its last byte: its events, timing metrics, stats, release, cancel."""

    def __init__(self, ctx: ServingContext, prep: Prepared, d: Dispatched, endpoint: str,
                 tap: Tap | None = None) -> None:
        self.ctx, self.prep, self.d, self.endpoint = ctx, prep, d, endpoint
        self.tap = tap  # a shadow copy of this request is in flight: it reads this answer (gateway/serving/mirror.py)
        prompt = d.first.prompt  # the engine's first message says how much of the prompt was cached
        self._usage = {"prompt_tokens": prompt.prompt_tokens or len(prep.prompt_ids),
                       "cached_tokens": prompt.cached_tokens, "completion_tokens": 0}  # outputs() keeps it
        self.prompt_logprobs = list(d.first.prompt_logprobs)  # pb.TokenLogprob per prompt token from the 2nd
        tools = prep.api.tools
        self._parsers = ([ToolCallParser(tools.choice, tools.function, i) for i in range(prep.api.sampling.n)]
                         if tools is not None and tools.active else None)
        dec = d.decision
        self.labels = (prep.model.model_id, dec.engine_kind, dec.variant,
                       request_class(prep.api, prep.session_key, len(prep.prompt_ids)))
        self._itl = ctx.metrics.itl.labels(*self.labels)  # resolved once, observed per token
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.itls: list[float] = []

    @property
    def usage(self) -> Usage:
        """The request's usage so far: the prompt's from the start, all of it once every choice ended."""
        return Usage(**self._usage)

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
        ctx, dec, usage = self.ctx, self.d.decision, self.usage
        self.d.close()
        ctx.pending.release()
        ctx.metrics.requests.labels(self.endpoint, status).inc()
        ok = status == "200"
        if ok:
            ctx.metrics.e2e.labels(*self.labels).observe(time.perf_counter() - self.prep.arrival)
            m = self.labels[0]
            ctx.metrics.prompt_tokens.labels(m).inc(usage.prompt_tokens)
            ctx.metrics.cached_tokens.labels(m, dec.engine_kind).inc(usage.cached_tokens)
            ctx.metrics.generation_tokens.labels(m).inc(usage.completion_tokens)
            ctx.pool_tracker.finished(time.monotonic(), dec, ctx.router.block_size(m), usage.prompt_tokens,
                                      usage.cached_tokens, usage.completion_tokens)
        ttft_s = None if self.first_at is None else self.first_at - self.prep.arrival
        itl_s = sum(self.itls) / len(self.itls) if self.itls else None
        if ok:  # what routing predicted for it there against what it saw: the worker's learned correction
            ctx.router.observe(dec, ttft_s, itl_s)
        ctx.stats.record(
            model=self.labels[0], ok=ok or status == "499", engine_kind=dec.engine_kind, variant=dec.variant,
            worker_id=dec.worker_id, reason=dec.reason, ttft_s=ttft_s, itl_s=itl_s,
            output_tokens=usage.completion_tokens,
        )
        if self.tap is not None:
            self.tap.primary_finished(status, ttft_s, itl_s)
        if ok:  # the live profile and the traffic capture (gateway/control/workload.py)
            ctx.workload.finished(
                model=self.labels[0], session=self.prep.session_key, turns=self.prep.api.turn_count,
                hashes=self.d.block_hashes, prompt_ids=self.prep.prompt_ids, tenant_salt=self.prep.cache_salt,
                traffic_class=self.labels[3], output_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                engine=dec.engine_kind, duration_s=time.perf_counter() - self.prep.arrival, ttft_s=ttft_s, tpot_s=itl_s)

    def _logprob(self, lp) -> TokenLogprob:
        decode = self.prep.model.tokenizer.decode
        return TokenLogprob(decode([lp.token_id], skip_special_tokens=False), lp.logprob,
                            tuple((decode([a.token_id], skip_special_tokens=False), a.logprob)
                                  for a in lp.top[: self.prep.api.sampling.top_logprobs]))

    def _events(self, d: Delta) -> list[Event]:
        """The events of one engine message (one choice's): its text, or the tool calls parsed from it
        (the message's logprobs then ride on a Content of their own), and its Finish."""
        lps = tuple(self._logprob(lp) for lp in d.logprobs) if self.prep.api.sampling.logprobs else ()
        parser = self._parsers[d.index] if self._parsers is not None else None
        if parser is None:
            out: list[Event] = [Content(d.text, d.index, lps)] if d.text or lps else []
        else:
            out = [Content("", d.index, lps)] if lps else []
            out += parser.feed(d.text) + (parser.finish() if d.finish_reason is not None else [])
        if d.finish_reason is not None:
            called = parser is not None and parser.calls and d.finish_reason == "stop"
            out.append(Finish(d.index, "tool_calls" if called else d.finish_reason, d.stop_sequence, self.usage))
        return out

    async def _steps(self):
        async for delta in outputs(self.prep, self.d, self._usage):
            self._tick(delta)
            yield self._events(delta)

    async def events(self):
        """The answer as typed events, one list per engine message (empty while nothing is visible yet),
        for a stream to render as they come. Use it under `contextlib.aclosing`, which finishes the run on
        any exit; a failure mid-stream is counted and raised (GatewayError)."""
        status = "499"  # until proven otherwise: the client went away
        try:
            # `_steps` written out: one async generator fewer between the engine and the client at every token
            async for delta in outputs(self.prep, self.d, self._usage):
                self._tick(delta)
                yield self._events(delta)
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

    async def _gather(self) -> list[Event]:
        return [e async for step in self._steps() for e in step]


async def collect(runs: list[Run], gone, headers: dict, whole, render_error=errors.error_response) -> Response:
    """Every event of every run, then the answer `await whole(events)` (`events`: one list per run); `gone`
    (a coroutine) finishing first means the client left, which cancels the engine calls (499). A failure
    is the answer (`render_error`); the other runs are stopped. Every run is finished however it ends,
    and every task this starts has ended (none left running, none with an unread error) when it returns."""
    tasks = [asyncio.ensure_future(r._gather()) for r in runs]
    watcher = asyncio.ensure_future(gone)
    status = "499"
    try:
        waiting = set(tasks)
        while waiting:
            done, waiting = await asyncio.wait(waiting | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            failed = next((t.exception() for t in tasks if t in done and t.exception() is not None), None)
            if isinstance(failed, errors.GatewayError):
                status = str(failed.status)
                return render_error(failed, headers)
            if failed is not None:
                raise failed
            if watcher in done and waiting:  # (a client that left after the last token still gets it)
                return Response(status_code=499)
            waiting.discard(watcher)
        status = "200"
        return JSONResponse(await whole([t.result() for t in tasks]), headers=headers)
    finally:
        for t in (*tasks, watcher):  # after a failure (or a client gone) the other runs may still be reading
            t.cancel()
        await asyncio.wait([*tasks, watcher])
        for t in (*tasks, watcher):
            if not t.cancelled():
                t.exception()  # read: a run stopped by another's failure has nothing left to say
        for r in runs:
            if status == "499":
                r.ctx.metrics.cancelled.inc()
            r.finish(status)


async def disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
