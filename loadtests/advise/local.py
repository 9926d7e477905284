"""`duet bench advise` without --simulate or --fleet: the options for real on this machine, judged by the one rule
(loadtests/advise/rule.py). all_paged, all_prefix and Duet at the split the routing simulation finds best
(loadtests/advise/routing_sim.py) each run as `duet bench compare`'s stacks (the same engines, limits and
gateway; loadtests/stack/serving.py) on the first `--limit` records of the trace, so the engines' own
differences count too.
"""

from __future__ import annotations

from pathlib import Path

from loadtests.advise.routing_sim import AdviseSettings, reuse_share, simulate_all
from loadtests.advise.rule import recommend
from loadtests.traces.mooncake import TraceRecord


def advise_local(trace: str, s: AdviseSettings, model: str | None = None, max_prompt_tokens: int = 1024,
                 max_tokens: int = 32, log_dir: Path | None = None, progress=None) -> dict:
    """Each deployment for real on this machine (the first `s.limit` records, default 200; prompts cut
    to `max_prompt_tokens`, outputs to `max_tokens`, so a CPU replays them), Duet with the split the
    simulation finds best. The same engines, limits and gateway as `duet bench compare`."""
    import asyncio

    from duet.tokenizer import Tokenizer
    from loadtests.experiments import compare
    from loadtests.load.report import Slo, summarize
    from loadtests.load.workloads import BenchRequest, TokenSource
    from loadtests.stack.serving import ServingStack, preset_checkpoint
    from loadtests.traces.formats import detect_format, load_any

    s.validate()
    records = load_any(trace)[: s.limit or 200]
    simulated = simulate_all(records, s)
    reuse = reuse_share(records)
    split = simulated[recommend(simulated, reuse)["best_split"]]["workers"]
    model_dir = Path(model).expanduser().resolve() if model else preset_checkpoint("bench")
    src = TokenSource.from_model_dir(model_dir)
    t0 = records[0].timestamp_ms
    requests = []
    for i, rec in enumerate(records):
        ids: list[int] = []
        for h in rec.hash_ids:  # each block id is a fixed run of tokens: shared prefixes stay shared
            ids += src.block(h)
            if len(ids) >= min(rec.input_length, max_prompt_tokens):
                break
        requests.append(BenchRequest(f"trace-{i}", "trace", tuple(ids[:min(rec.input_length, max_prompt_tokens)]),
                                     max(1, min(rec.output_length, max_tokens)),
                                     arrival_s=(rec.timestamp_ms - t0) / 1000.0 * s.time_scale,
                                     session_id=_session(rec)))
    encode = Tokenizer.from_dir(model_dir).encode
    slo = Slo(ttft_ms=1000 * s.slo_ttft_s, itl_ms=compare.Settings().itl_slo_ms)
    stacks = {"all_paged": (["paged"] * s.workers, "sglang_cache_aware"),
              "all_prefix": (["prefix"] * s.workers, "sglang_cache_aware"),
              f"duet_{split['paged']}": (["paged"] * split["paged"] + ["prefix"] * split["prefix"], "duet")}
    results = {}
    for name, (kinds, policy) in stacks.items():
        sub = None if log_dir is None else Path(log_dir) / name
        if sub is not None:
            sub.mkdir(parents=True, exist_ok=True)
        with ServingStack(model_dir, kinds, {}, compare.Settings().limits, 300.0, sub,
                          gateway_extra=compare.gateway_policy(policy)) as stack:
            recs = asyncio.run(arun_open_loop(stack.url, model_dir.name, requests, encode))
        summary = summarize(recs, slo)
        results[name] = {"workers": {"paged": kinds.count("paged"), "prefix": kinds.count("prefix")},
                         "goodput_rps": summary["goodput_rps"], "slo_attainment":
                         summary["num_good"] / max(1, summary["num_requests"]),
                         "ttft_p50_s": (summary["ttft_ms"]["p50"] or 0) / 1000,
                         "ttft_p99_s": (summary["ttft_ms"]["p99"] or 0) / 1000,
                         "num_errors": summary["num_errors"]}
        if progress is not None:
            progress(f"{name}: goodput {results[name]['goodput_rps']:.3f} req/s, {summary['num_errors']} errors")
    return {"trace": str(trace), "format": detect_format(trace), "records": len(records), "mode": "local replay",
            "settings": {"workers": s.workers, "slo_ttft_s": s.slo_ttft_s, "time_scale": s.time_scale,
                         "model": model_dir.name}, "stacks": results, "simulated": simulated,
            "recommendation": recommend(results, reuse)}


async def arun_open_loop(url: str, model: str, requests, encode):
    from loadtests.load.client import arun_benchmark

    return await arun_benchmark(url, model, requests, encode=encode, progress=False)


def _session(rec: TraceRecord) -> str | None:
    from loadtests.traces.mooncake import session_key

    return session_key(rec)
