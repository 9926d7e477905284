"""Benchmark results: a JSON summary, a markdown table and PNG plots from a list of `RequestRecord`.

Public API (used by `duet bench run` and `duet bench compare`):

    Slo(ttft_ms=None, itl_ms=None)          the service-level objectives of goodput (None: no bound)
    summarize(records, slo=Slo()) -> dict   the summary below
    format_markdown(summary) -> str         one table: overall, then per class / engine / variant / route reason
    write_plots(records, out_dir) -> list[Path]   latency_cdf.png, throughput.png

The summary (every key always present; latency stats are None when no request succeeded):

    num_requests, num_ok, num_errors, num_good, duration_s, slo: {ttft_ms, itl_ms},
    request_throughput_rps, input_token_throughput_tps, output_token_throughput_tps, goodput_rps,
    ttft_ms, itl_ms, tpot_ms, e2e_ms: {mean, p50, p90, p99}, cached_token_ratio (None: not reported),
    errors: {message: count} (at most 10),
    by_class, by_engine, by_variant, by_route_reason: {value: the same summary without by_* keys}

`duration_s` runs from the first request sent to the last one finished, for every breakdown alike,
so per-class throughputs add up to the total. A request is *good* when it succeeded, its TTFT is
within `slo.ttft_ms` and its mean inter-token latency (TPOT) within `slo.itl_ms`. Requests without
a header (another server) are left out of that header's breakdown.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests.load.client import RequestRecord

BREAKDOWNS = {"by_class": "traffic_class", "by_engine": "engine", "by_variant": "variant",
              "by_route_reason": "route_reason"}
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        return self.itl_ms is None or tpot is None or tpot * 1000 <= self.itl_ms


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _window(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def _group(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    good = sum(1 for r in ok if slo.met(r))
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    cached = [r for r in ok if r.cached_tokens is not None]
    prompt_of_cached = sum(r.prompt_tokens for r in cached)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "num_good": good,
        "duration_s": duration_s,
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
        "request_throughput_rps": per_s(len(ok)),
        "input_token_throughput_tps": per_s(sum(r.prompt_tokens for r in ok)),
        "output_token_throughput_tps": per_s(sum(r.output_tokens for r in ok)),
        "goodput_rps": per_s(good),
        "ttft_ms": _stats([r.ttft_s for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itl_s]),
        "tpot_ms": _stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": _stats([r.e2e_s for r in ok]),
        "cached_token_ratio": sum(r.cached_tokens for r in cached) / prompt_of_cached if prompt_of_cached else None,
        "errors": dict(Counter(r.error for r in records if r.error).most_common(10)),
    }


def summarize(records: Sequence[RequestRecord], slo: Slo = Slo()) -> dict:
    duration = _window(records)
    out = _group(records, slo, duration)
    for key, attr in BREAKDOWNS.items():
        groups: dict[str, list[RequestRecord]] = {}
        for r in records:
            value = getattr(r, attr)
            if value is not None:
                groups.setdefault(value, []).append(r)
        out[key] = {v: _group(rs, slo, duration) for v, rs in sorted(groups.items())}
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_markdown(summary: dict) -> str:
    cols = ("group", "requests", "errors", "req/s", "goodput/s", "out tok/s", "TTFT p50", "TTFT p99",
            "ITL p50", "ITL p99", "TPOT p50", "e2e p50", "e2e p99")
    rows = [("all", summary)]
    for key in BREAKDOWNS:
        rows += [(f"{key[3:]}={v}", s) for v, s in summary[key].items()]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, s in rows:
        cells = (name, str(s["num_requests"]), str(s["num_errors"]), f"{s['request_throughput_rps']:.2f}",
                 f"{s['goodput_rps']:.2f}", f"{s['output_token_throughput_tps']:.1f}",
                 _ms(s["ttft_ms"]["p50"]), _ms(s["ttft_ms"]["p99"]), _ms(s["itl_ms"]["p50"]),
                 _ms(s["itl_ms"]["p99"]), _ms(s["tpot_ms"]["p50"]), _ms(s["e2e_ms"]["p50"]), _ms(s["e2e_ms"]["p99"]))
        lines.append("| " + " | ".join(cells) + " |")
    slo = summary["slo"]
    lines.append(f"\nlatencies in ms; goodput: requests with TTFT <= {slo['ttft_ms'] or 'any'} ms and TPOT <= "
                 f"{slo['itl_ms'] or 'any'} ms, over {summary['duration_s']:.1f} s")
    return "\n".join(lines)


def write_plots(records: Sequence[RequestRecord], out_dir: str | Path) -> list[Path]:
    """latency_cdf.png: TTFT, inter-token and e2e latency CDFs per traffic class; throughput.png:
    output tokens/s and finished requests/s over time (1 s bins)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    classes = sorted({r.traffic_class for r in ok})

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (title, get) in zip(axes, (("TTFT", lambda r: [r.ttft_s]), ("inter-token latency", lambda r: r.itl_s),
                                        ("end-to-end latency", lambda r: [r.e2e_s]))):
        for cls in classes or ["(none)"]:
            values = np.sort([x * 1000 for r in ok if r.traffic_class == cls for x in get(r)])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=cls)
        ax.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ok:
            ax.legend(fontsize=8)
    fig.tight_layout()
    cdf = out / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    if ok:
        t0 = min(r.start_s for r in records)
        span = max(r.end_s for r in records) - t0
        bins = np.arange(0, max(1.0, np.ceil(span)) + 1)
        token_times = [r.start_s - t0 + t for r in ok for t in r.chunk_times_s]
        token_weights = [r.output_tokens / len(r.chunk_times_s) for r in ok for _ in r.chunk_times_s]
        tokens, _ = np.histogram(token_times, bins=bins, weights=token_weights)
        done, _ = np.histogram([r.end_s - t0 for r in ok], bins=bins)
        ax.step(bins[:-1], tokens, where="post", label="output tokens/s")
        ax2 = ax.twinx()
        ax2.step(bins[:-1], done, where="post", color="tab:orange", label="requests finished/s")
        ax2.set_ylabel("requests/s")
        ax2.legend(loc="upper right", fontsize=8)
    ax.set(title="throughput over time", xlabel="s from start", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    tput = out / "throughput.png"
    fig.savefig(tput, dpi=100)
    plt.close(fig)
    return [cdf, tput]
