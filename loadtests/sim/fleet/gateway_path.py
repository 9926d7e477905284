"""What the simulator models of the path between the client and a worker (`duet bench fleet --validate`).

The real stack puts one gateway process between the client and the workers, and what it does shapes TTFT
beyond its own few milliseconds:

- `request_s`: a request's time in the gateway before the worker has it (HTTP parse, validation, block
  hashes, routing, the gRPC send). The gateway is one asyncio loop, so it handles requests one after
  another: a burst of simultaneous sends reaches a worker spread out, and an idle worker starts a step with
  the first of them while the rest wait for the next step. The simulator serves requests through the
  gateway in FIFO order at `request_s` each.
- `token_s`: a token's time from the worker's step end to the client (the gRPC stream, detokenize, SSE);
  added to each token's arrival.
- `poll_interval_s`: the gateway sees a worker's running / waiting / KV usage from its GetLoad poll
  (gateway/backends/fleet.py), not live; routing reads that snapshot (its queued-prefill count is its own, live).
  None: the live scheduler state (the simulator's default for `duet bench fleet`). `poll_phase_s` is when the
  first poll falls: the real gateway's polls run at a phase nothing aligns with the arrivals, while a trace's
  scaled timestamps often fall on whole seconds, so a poll at 0, 0.5, 1.0 ... would read every such burst
  just before it lands (`--validate` simulates several phases and reports their median).

`request_s` and `token_s` are measured on the local stack by `duet bench fleet-calibrate --gateway`
(loadtests/sim/calibrate/gateway_timing.py) and stored in the `gateway` section of the cpu fit (loadtests/sim/fleet/cpu_fit.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadtests.sim.fleet.cpu_fit import fit_path


@dataclass(frozen=True)
class GatewayPath:
    request_s: float = 0.0
    token_s: float = 0.0
    poll_interval_s: float | None = None
    poll_phase_s: float = 0.0

    def __post_init__(self) -> None:
        if self.request_s < 0 or self.token_s < 0:
            raise ValueError(f"gateway path times must be >= 0, got {self.request_s} and {self.token_s}")
        if self.poll_interval_s is not None and self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0 (or None: live), got {self.poll_interval_s}")
        if self.poll_phase_s < 0:
            raise ValueError(f"poll_phase_s must be >= 0, got {self.poll_phase_s}")

    @classmethod
    def from_json(cls, poll_interval_s: float | None, path: Path | None = None) -> GatewayPath:
        """The measured path in the fit's `gateway` section (default file: cpu_fit.fit_path()); a fit without one is
        an error (measure it)."""
        path = Path(path) if path is not None else fit_path()
        section = json.loads(Path(path).read_text()).get("gateway")
        if not section:
            raise ValueError(f"{path} has no `gateway` section: run `duet bench fleet-calibrate --gateway`")
        return cls(section["request_s"], section["token_s"], poll_interval_s)


class GatewayQueue:
    """The gateway's one loop: FIFO, `request_s` per request. `admit(t)` is when a request sent at `t`
    reaches its worker (sends are admitted in time order)."""

    def __init__(self, request_s: float) -> None:
        self.request_s = request_s
        self.free_at = 0.0

    def admit(self, t: float) -> float:
        self.free_at = max(t, self.free_at) + self.request_s
        return self.free_at
