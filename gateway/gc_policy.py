"""The gateway process's cyclic-GC policy (the config's `gc:` section), applied once by `duet gateway` when the app
is built, and the GC's state on /metrics.

Why: with Python's defaults (a collection of generation 0 every 700 net allocations, a full one after ten of
generation 1) the cyclic GC took 19-26% of the gateway's CPU under 1,000 concurrent streams, half of it in full
collections that walk every object of the streams in flight and everything startup built (tokenizers, routes,
metrics, the fleet): docs/benchmarks.md. The objects startup builds live as long as the process, so `freeze`
moves them out of the GC's generations for good (gc.freeze: never walked again, never freed, whatever they
refer to); a larger `gen0_threshold` collects the short-lived per-request objects less often, each collection
then finding more of them already freed by reference counting. Cyclic garbage is still collected, by the same
generational rules, in larger batches. Measured (docs/benchmarks.md, the GC-policy bullet): 11-13% less CPU per
request, no full collection in a 1,000-stream burst, and over 60,000 streamed requests the same RSS as with
Python's own GC. `freeze: false, gen0_threshold: null` is Python's own GC.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass(frozen=True)
class GcPolicy:
    freeze: bool = True  # gc.freeze() what startup allocated, once the app is built
    # allocations (net of frees) of GC-tracked objects between two generation-0 collections; None: Python's own
    # (700). Generations 1 and 2 keep Python's thresholds (each 10 collections of the generation below)
    gen0_threshold: int | None = 10_000

    def validate(self) -> GcPolicy:
        if self.gen0_threshold is not None and (isinstance(self.gen0_threshold, bool)
                                                or not isinstance(self.gen0_threshold, int)
                                                or self.gen0_threshold < 1):
            raise ValueError(f"gc.gen0_threshold must be an integer >= 1 (or null: Python's own), "
                             f"got {self.gen0_threshold!r}")
        return self


def apply(policy: GcPolicy) -> None:
    """Apply `policy` to this process. Called once startup has built what lives as long as the process (the
    app, its models' tokenizers, the router); a collection first, so that startup's own garbage is freed, not
    frozen."""
    if policy.gen0_threshold is not None:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(policy.gen0_threshold, gen1, gen2)
    if policy.freeze:
        gc.collect()
        gc.freeze()


class GcCollector(Collector):
    """The process's GC on /metrics, read at scrape time (no gc.callbacks: a callback on every collection would
    cost the request path what the policy saves): collections per generation, the thresholds in force and the
    objects frozen."""

    def collect(self) -> Iterator:
        collections = CounterMetricFamily("duet_gateway_gc_collections", "Cyclic GC collections of the gateway "
                                          "process, by generation (2: full)", labels=["generation"])
        threshold = GaugeMetricFamily("duet_gateway_gc_threshold", "The GC's thresholds in force "
                                      "(gc.get_threshold), by generation", labels=["generation"])
        for gen, (stats, limit) in enumerate(zip(gc.get_stats(), gc.get_threshold(), strict=True)):
            collections.add_metric([str(gen)], stats["collections"])
            threshold.add_metric([str(gen)], limit)
        yield collections
        yield threshold
        yield GaugeMetricFamily("duet_gateway_gc_frozen_objects", "Objects gc.freeze() took out of the "
                                "GC's generations (0: no freeze)", value=gc.get_freeze_count())


def register_metrics(registry: CollectorRegistry) -> None:
    registry.register(GcCollector())
