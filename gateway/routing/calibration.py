"""What routing's latency model misses on each worker, learned from the requests served there (issue 45).

Routing predicts a request's TTFT and TPOT on each candidate from the engines' measured rates and queues
(gateway/routing/policy.py, `Latency`). The model leaves things out: the fixed cost of a first token, a vLLM
step's prefill chunks stalling every decode in it, a worker sharing its cores with a neighbour. Rather than
modelling each, the gateway compares what each request really saw on its worker with what the model predicted
for it there when it was routed, and keeps, per worker and per figure, the ratio

    correction = sum(observed) / sum(predicted)    over the worker's last `window` requests

which scales every later prediction on that worker (llm-d's predicted-latency scheduler learns from observed
latencies in the same spirit). A ratio of sums, as the engines' own rates (engine_core/step_rates.py): a
request that waited long weighs more than one that hardly waited, and the long waits are the ones the
saturation test is about. The model's own prediction is what is compared (`RouteDecision.modelled_ttft_s`),
never the corrected one, so the correction converges to the ratio instead of chasing itself. Until a worker has
`min_samples` requests the correction is 1 (the model as it is). The gateway's observed TTFT runs from the
request's arrival (what the client felt), so a wait in flow control's queue before routing counts too: a long
admission queue reads as a slower worker. The corrections are the prediction error per
worker on the gateway's /metrics (`duet_route_ttft_correction`, `duet_route_tpot_correction`). A worker that
leaves the fleet is forgotten (gateway/serving/router.py `forget`, called by the fleet's `on_gone`; its gauges
go with its other series, gateway/metrics.py `forget_worker`): one that comes back, or a new worker under its id,
starts at 1.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

WINDOW = 32  # requests per worker the ratio is taken over
MIN_SAMPLES = 8  # requests a worker must have served before its correction applies


class Correction(NamedTuple):
    ttft: float = 1.0  # observed over predicted TTFT on the worker
    tpot: float = 1.0


NONE = Correction()


class _Ratio:
    """sum(observed) / sum(predicted) over the last `window` samples, read in O(1): the gateway's `Router.views()`
    reads every worker's correction on every routing decision, and summing the window each time cost 2 x window
    additions per worker per request. Running sums are kept instead, the evicted sample subtracted. Adding and
    subtracting floats of different sizes leaves rounding behind (a 30 s wait evicted from a sum of 0.01 s
    ones), and that residue would outlive every sample it came from; so every `window` appends the sums are
    taken again from the samples (exact again, the cost spread to O(1) per append): between two recounts the
    error is at most `window` roundings of the largest sum seen, far below what a correction can resolve."""

    def __init__(self, window: int) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (predicted, observed)
        self.predicted = 0.0
        self.observed = 0.0
        self._until_recount = window

    def add(self, predicted: float, observed: float) -> None:
        samples = self.samples
        if len(samples) == samples.maxlen:
            p, o = samples[0]  # the one the append evicts
            self.predicted -= p
            self.observed -= o
        samples.append((predicted, observed))
        self._until_recount -= 1
        if self._until_recount == 0:
            self._until_recount = samples.maxlen
            self.predicted = sum(p for p, _ in samples)
            self.observed = sum(o for _, o in samples)
        else:
            self.predicted += predicted
            self.observed += observed

    def value(self, min_samples: int) -> float:
        if len(self.samples) < min_samples:
            return 1.0
        return self.observed / self.predicted if self.predicted > 0 else 1.0


class LatencyCalibration:
    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window} and {min_samples}")
        self.window, self.min_samples = window, min_samples
        self._ttft: dict[str, _Ratio] = {}
        self._tpot: dict[str, _Ratio] = {}

    def observe(self, worker_id: str, predicted_ttft_s: float | None, ttft_s: float | None,
                predicted_tpot_s: float | None = None, tpot_s: float | None = None) -> Correction:
        """One request served on `worker_id`: the model's predictions for it there, and what it saw (None: no
        prediction, or nothing seen: a one-token answer has no TPOT). Returns the worker's correction now."""
        for table, predicted, observed in ((self._ttft, predicted_ttft_s, ttft_s),
                                           (self._tpot, predicted_tpot_s, tpot_s)):
            if predicted is not None and observed is not None and predicted > 0 and observed >= 0:
                table.setdefault(worker_id, _Ratio(self.window)).add(predicted, observed)
        return self.correction(worker_id)

    def correction(self, worker_id: str) -> Correction:
        ttft, tpot = self._ttft.get(worker_id), self._tpot.get(worker_id)
        return Correction(ttft.value(self.min_samples) if ttft else 1.0,
                          tpot.value(self.min_samples) if tpot else 1.0)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet (or restarted as another kind): what it showed no longer holds."""
        self._ttft.pop(worker_id, None)
        self._tpot.pop(worker_id, None)
