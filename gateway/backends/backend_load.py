"""An external engine's `/metrics` (Prometheus text) read as Duet's `EngineLoad`, so the worker view,
routing's load signal, the pool planner and the stall watchdog see a vLLM or SGLang server as they
see Duet's own workers.

    EngineLoad field          vLLM                                   SGLang
    num_running               vllm:num_requests_running              sglang:num_running_reqs
    num_waiting               vllm:num_requests_waiting              sglang:num_queue_reqs
    kv usage (per mille)      vllm:kv_cache_usage_perc (0..1)        sglang:token_usage (0..1)
    prefix cache queries/hits vllm:prefix_cache_queries/hits_total   sglang:prompt_tokens_total, cached_tokens_total
    num_steps (progress)      prompt + generation tokens so far      the same, sglang:* names
    prefill_tokens_per_s      delta vllm:request_prefill_kv_computed_tokens_sum   none (the gateway's observed
                              over delta vllm:request_prefill_time_seconds_sum     rate, pool_tracker.py)
    decode_tokens_per_s       delta ITL count / (delta steps x mean ITL), from     none
                              vllm:inter_token_latency_seconds_sum and _count,
                              vllm:iteration_tokens_total_count (steps)

`num_steps` is a progress counter, not a step count: it moves whenever the engine makes tokens, which
is what the watchdog asks ("has a worker with work stopped moving?"). Series with several label sets
(one per model or engine index) are summed. A metric the server does not export reads as 0.

The two rates are what Duet's own workers report (engine_core/step_rates.py), rates while busy, not throughput
over the poll interval (idle seconds would count): `BusyRates` keeps the previous poll's counters and divides
their deltas.
- prefill: the prompt tokens the requests finished since the last poll computed (their cached ones left out)
  over those same requests' prefill seconds (scheduled to first token). Both halves are vLLM's per-request
  histograms, observed together when a request finishes, so they describe the same requests. Prefills batched
  into one step each count that step, so with several prompts in flight the rate reads low (TTFT predicted
  long: the cautious side).
- decode: the tokens decoded since the last poll (the inter-token latency samples) over the time the engine
  spent stepping: its steps since then times the mean gap between a request's tokens (a step's duration).
  Tokens per second of a step's batch, as the routing's TPOT (batch with the request over the rate) wants;
  per request decode seconds would count a batch of eight's step eight times.
An interval with nothing finished or decoded keeps the last rate (an idle engine is as fast as it was); a
counter that went back (the server restarted) makes the new reading the baseline and keeps the last rates.

The page is searched for the names above only (one compiled regex, not a loop over its lines). vLLM's page is mostly histograms (tens of
kilobytes); a full Prometheus parse of it took about 20 ms of the gateway's event loop at every poll, which
profiling a gateway over vLLM found to be half the gateway's CPU and a stall of every stream it carried.
The gateway asks for those series only (`GET /metrics?name[]=...`, which prometheus_client's exposition
honours by sample name, so a histogram's `_sum` and `_count` come without its buckets, and the page is about a
kilobyte). vLLM 0.32 does not: its /metrics route (prometheus_fastapi_instrumentator's `expose`, registered
before the prometheus_client app vLLM also mounts there) ignores the query and sends the whole page, so over
vLLM the line scan above is what keeps a poll cheap.
"""

from __future__ import annotations

import functools
import os
import re

from duet.rpc import engine_pb2 as pb

KV_SCALE = 1000  # kv usage travels as pages used / pages total: per mille of a fraction

NAMES = {
    "vllm": {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv_usage": "vllm:kv_cache_usage_perc", "queries": "vllm:prefix_cache_queries_total",
             "hits": "vllm:prefix_cache_hits_total", "preemptions": "vllm:num_preemptions_total",
             "prompt": "vllm:prompt_tokens_total", "generation": "vllm:generation_tokens_total",
             "prefill_tokens": "vllm:request_prefill_kv_computed_tokens_sum",
             "prefill_s": "vllm:request_prefill_time_seconds_sum",
             "itl_s": "vllm:inter_token_latency_seconds_sum",
             "itl_n": "vllm:inter_token_latency_seconds_count",
             "steps": "vllm:iteration_tokens_total_count"},
    "sglang": {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
               "kv_usage": "sglang:token_usage", "queries": "sglang:prompt_tokens_total",
               "hits": "sglang:cached_tokens_total", "preemptions": "sglang:num_retractions_total",
               "prompt": "sglang:prompt_tokens_total", "generation": "sglang:generation_tokens_total"},
}


@functools.lru_cache(maxsize=16)
def _sample_lines(names: frozenset[str]) -> re.Pattern:
    """A regex for the sample lines of `names`: a newline, the names' common prefix (a literal the regex engine
    searches at C speed, so the rest of the page is skipped without a Python step per line), one of the names,
    then its labels (to the line's last `}`: a label value may hold spaces) and its value."""
    prefix = os.path.commonprefix(sorted(names))
    tails = "|".join(re.escape(n[len(prefix):]) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"\n{re.escape(prefix)}({tails})(?:{{[^\n]*}})?[ \t]+([^ \t\n]+)")


def sample_sums(text: str, names: frozenset[str]) -> dict[str, float]:
    """Sample name -> the sum of its values over every label set, for the sample names in `names`
    (Prometheus text format: `name{labels} value [timestamp]`, or `name value [timestamp]`). vLLM's page is tens
    of kilobytes of series the gateway does not read, polled every second: a Python loop over its lines cost
    about 0.3 ms a page, this regex about 0.06 (docs/benchmarks.md, the gateway's CPU per request)."""
    if not names:
        return {}
    pattern = _sample_lines(names)
    prefix = os.path.commonprefix(sorted(names))
    sums: dict[str, float] = {}
    for tail, raw in pattern.findall("\n" + text):  # the first line starts after a newline too
        try:
            value = float(raw)
        except ValueError:
            continue  # a malformed line reads as absent, as the module doc says of a missing metric
        name = prefix + tail
        sums[name] = sums.get(name, 0.0) + value
    return sums


def metric_names(engine: str) -> list[str]:
    """The sample names `engine_load` reads of this engine's page."""
    return sorted(NAMES.get(engine, NAMES["vllm"]).values())


RATE_KEYS = ("prefill_tokens", "prefill_s", "itl_s", "itl_n", "steps")


class BusyRates:
    """One backend's prefill and decode rates while busy, from the deltas of its counters between polls
    (module doc). 0.0 until an interval shows some."""

    def __init__(self) -> None:
        self._last: dict[str, float] | None = None
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        # decode tokens a step over the same interval as the decode rate (the batch it was measured at: the gateway's
        # worker rows show it, and `duet bench advise` splits the step into a fixed and a per-token cost with it)
        self.decode_tokens_per_step = 0.0

    def update(self, counters: dict[str, float]) -> None:
        last, self._last = self._last, counters
        if last is None:
            return
        d = {k: counters.get(k, 0.0) - last.get(k, 0.0) for k in RATE_KEYS}
        if any(v < 0 for v in d.values()):
            return  # a counter went back: the server restarted, and this reading is the new baseline
        if d["prefill_tokens"] > 0 and d["prefill_s"] > 0:
            self.prefill_tokens_per_s = d["prefill_tokens"] / d["prefill_s"]
        if d["itl_n"] > 0 and d["itl_s"] > 0 and d["steps"] > 0:
            step_s = d["itl_s"] / d["itl_n"]  # the mean gap between a request's tokens: one step's time
            self.decode_tokens_per_s = d["itl_n"] / (d["steps"] * step_s)
            self.decode_tokens_per_step = d["itl_n"] / d["steps"]


def engine_load(text: str, engine: str, rates: BusyRates | None = None) -> pb.EngineLoad:
    """The load a backend's /metrics page describes (engine `openai`: vLLM's names, if it has them). With
    `rates` (the backend's, kept between polls) it carries the prefill and decode rates as well."""
    names = NAMES.get(engine, NAMES["vllm"])
    sums = sample_sums(text, frozenset(names.values()))

    def get(key: str) -> float:
        return sums.get(names[key], 0.0) if key in names else 0.0

    usage = min(max(get("kv_usage"), 0.0), 1.0)
    load = pb.EngineLoad(
        num_running=int(get("running")), num_waiting=int(get("waiting")),
        kv_pages_used=round(usage * KV_SCALE), kv_pages_total=KV_SCALE,
        prefix_cache_queries_tokens=int(get("queries")), prefix_cache_hits_tokens=int(get("hits")),
        num_preemptions=int(get("preemptions")), num_steps=int(get("prompt") + get("generation")))
    if rates is not None:
        rates.update({k: get(k) for k in RATE_KEYS})
        load.prefill_tokens_per_s = rates.prefill_tokens_per_s
        load.decode_tokens_per_s = rates.decode_tokens_per_s
    return load
