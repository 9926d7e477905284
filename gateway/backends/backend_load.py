"""An external engine's `/metrics` (Prometheus text) read as Duet's `EngineLoad`, so the worker view,
routing's load signal, the pool planner and the stall watchdog see a vLLM or SGLang server as they
see Duet's own workers.

    EngineLoad field          vLLM                                   SGLang
    num_running               vllm:num_requests_running              sglang:num_running_reqs
    num_waiting               vllm:num_requests_waiting              sglang:num_queue_reqs
    kv usage (per mille)      vllm:kv_cache_usage_perc (0..1)        sglang:token_usage (0..1)
    prefix cache queries/hits vllm:prefix_cache_queries/hits_total   sglang:prompt_tokens_total, cached_tokens_total
    num_steps (progress)      prompt + generation tokens so far      the same, sglang:* names

`num_steps` is a progress counter, not a step count: it moves whenever the engine makes tokens, which
is what the watchdog asks ("has a worker with work stopped moving?"). Series with several label sets
(one per model or engine index) are summed. A metric the server does not export reads as 0.

The page is scanned line by line for the eight names above only. vLLM's page is mostly histograms (tens of
kilobytes); a full Prometheus parse of it took about 20 ms of the gateway's event loop at every poll, which
profiling a gateway over vLLM found to be half the gateway's CPU and a stall of every stream it carried.
The gateway asks for those eight only (`GET /metrics?name[]=...`, which prometheus_client's exposition
honours), so the page it reads is about a kilobyte.
"""

from __future__ import annotations

from duet.rpc import engine_pb2 as pb

KV_SCALE = 1000  # kv usage travels as pages used / pages total: per mille of a fraction

NAMES = {
    "vllm": {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv_usage": "vllm:kv_cache_usage_perc", "queries": "vllm:prefix_cache_queries_total",
             "hits": "vllm:prefix_cache_hits_total", "preemptions": "vllm:num_preemptions_total",
             "prompt": "vllm:prompt_tokens_total", "generation": "vllm:generation_tokens_total"},
    "sglang": {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
               "kv_usage": "sglang:token_usage", "queries": "sglang:prompt_tokens_total",
               "hits": "sglang:cached_tokens_total", "preemptions": "sglang:num_retractions_total",
               "prompt": "sglang:prompt_tokens_total", "generation": "sglang:generation_tokens_total"},
}


def sample_sums(text: str, names: frozenset[str]) -> dict[str, float]:
    """Sample name -> the sum of its values over every label set, for the sample names in `names`
    (Prometheus text format: `name{labels} value [timestamp]`, or `name value [timestamp]`)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line.rpartition("}")[2]  # a label value may hold spaces, not the value
        else:
            name, _, rest = line.partition(" ")
        if name not in names:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue  # a malformed line reads as absent, as the module doc says of a missing metric
        sums[name] = sums.get(name, 0.0) + value
    return sums


def metric_names(engine: str) -> list[str]:
    """The sample names `engine_load` reads of this engine's page."""
    return sorted(NAMES.get(engine, NAMES["vllm"]).values())


def engine_load(text: str, engine: str) -> pb.EngineLoad:
    """The load a backend's /metrics page describes (engine `openai`: vLLM's names, if it has them)."""
    names = NAMES.get(engine, NAMES["vllm"])
    sums = sample_sums(text, frozenset(names.values()))

    def get(key: str) -> float:
        return sums.get(names[key], 0.0)

    usage = min(max(get("kv_usage"), 0.0), 1.0)
    return pb.EngineLoad(
        num_running=int(get("running")), num_waiting=int(get("waiting")),
        kv_pages_used=round(usage * KV_SCALE), kv_pages_total=KV_SCALE,
        prefix_cache_queries_tokens=int(get("queries")), prefix_cache_hits_tokens=int(get("hits")),
        num_preemptions=int(get("preemptions")), num_steps=int(get("prompt") + get("generation")))
