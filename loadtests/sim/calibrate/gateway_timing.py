"""`duet bench fleet-calibrate --gateway`: measure the gateway path the fleet simulator models
(loadtests/sim/fleet/gateway_path.py) on the local stack --validate runs, and store it in the `gateway` section of
the cpu fit (fleet-calibrate's --out, else this machine's own: sim/fleet/cpu_fit.py; the step fit there is left as
it is).

One engine_paged worker, pinned, behind the gateway, with its step trace on (engine_core/step_trace.py). The
client sends `requests` streaming completions one at a time to the idle stack (token-id prompts of
`prompt_tokens`, each new so nothing is cached; one output token), stamping wall-clock send and finish times.
A request alone on an idle worker is one step of its own, so the trace's steps line up with the requests:
`request_s` = the step's start - send (gateway parse, hashes, routing, gRPC, the step thread's wake-up),
`token_s` = the token's arrival at the client (its finishing chunk) - the step's end. Medians are stored.
Both are CPU time of the gateway, client and worker on this machine: on a loaded machine they come out larger.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx


def _one(client: httpx.Client, url: str, model: str, prompt: list[int]) -> tuple[float, float]:
    """(wall time sent, wall time the finishing chunk arrived) of a one-token streaming completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    sent = time.time()
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"calibration request failed: HTTP {resp.status_code} {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            if any(c.get("finish_reason") for c in json.loads(line[5:]).get("choices") or ()):
                return sent, time.time()
    raise RuntimeError("calibration request: the stream ended without a finish_reason")


def measure_gateway(requests: int = 12, prompt_tokens: int = 512, out: Path | None = None, progress=None) -> dict:
    from loadtests.sim.fleet.cpu_fit import fit_path

    out = Path(out) if out is not None else fit_path()
    from engine_core.step_trace import read_traces
    from loadtests.sim.fleet.validate import cpu_stack

    if requests < 1 or prompt_tokens < 2:
        raise ValueError(f"--gateway needs >= 1 request of >= 2 prompt tokens, got {requests} and {prompt_tokens}")
    sends = []
    with (tempfile.TemporaryDirectory(prefix="duet-gateway-trace-") as tmp, cpu_stack(("paged",), Path(tmp)) as
          (stack, model_dir), httpx.Client(timeout=120.0) as client):
        _one(client, stack.url, model_dir.name, list(range(1, prompt_tokens + 1)))  # warm-up
        for i in range(requests):
            prompt = [(i * 7919 + j) % 30000 + 1 for j in range(prompt_tokens)]  # new each time: no cache hit
            time.sleep(0.3)  # the worker is idle (its step thread waiting) when the request comes
            sends.append(_one(client, stack.url, model_dir.name, prompt))
            if progress:
                progress(f"request {i + 1}/{requests}: {sends[-1][1] - sends[-1][0]:.3f} s")
        (steps,) = read_traces(Path(tmp)).values()
    steps = steps[1:]  # the warm-up's
    if len(steps) != len(sends):
        raise RuntimeError(f"{len(steps)} worker steps for {len(sends)} one-token requests (was the stack shared?)")
    request_s = [st["t"] - sent for st, (sent, _) in zip(steps, sends)]
    token_s = [finished - (st["t"] + st["step_s"]) for st, (_, finished) in zip(steps, sends)]
    section = {"request_s": round(statistics.median(request_s), 6), "token_s": round(statistics.median(token_s), 6),
               "how": f"duet bench fleet-calibrate --gateway (loadtests/sim/calibrate/gateway_timing.py): {requests} "
                      f"requests of {prompt_tokens} prompt tokens, one at a time, medians",
               "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "request_s_range": [round(min(request_s), 6), round(max(request_s), 6)],
               "token_s_range": [round(min(token_s), 6), round(max(token_s), 6)]}
    fit = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    fit["gateway"] = section
    Path(out).write_text(json.dumps(fit, indent=1) + "\n")
    return section
