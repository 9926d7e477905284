"""Where a served worker's time goes: one Duet worker behind the gateway under a `duet bench peer` load, with
py-spy sampling it.

    python -m loadtests.profiles.profile_served [--engine paged|prefix] [--load shared_prefix|unique] [--num-prompts 64]
                                       [--concurrency 16] [--rate 50] [--out DIR]

The stack, limits, threads, prompts and warm-up are `duet bench peer`'s (loadtests/experiments/peer.py). After the warm-up,
`py-spy record --native --idle --threads --format raw` samples the worker while the measured prompts run; py-spy
is not a project dependency (`pip install py-spy`). Native stacks pause the process at every sample, so the
load's own figures come out slower than in `duet bench peer`: the shares are the result.

Printed, as JSON: the load's figures; the step thread's samples by phase (forward, process, schedule, idle, waiting to
retake the GIL); the forward's samples by cost; and the share of samples in which the event-loop (gRPC) thread
was busy. The raw profile stays in --out for a flame graph.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

STEP_THREAD = "duet-step-loop"  # engine_core.step_loop names its thread so
EVENT_LOOP_THREAD = "MainThread"
# a thread sampled inside one of these native calls is waiting, not working
_WAITING = ("epoll_wait", "poll (", "select (", "futex", "pthread_cond_wait", "pthread_cond_timedwait", "nanosleep")
_GIL = ("~gil_scoped_release", "take_gil", "PyEval_RestoreThread", "PyGILState_Ensure")

# the forward's costs, first match wins (frames are searched in the whole stack)
FORWARD_COSTS = (
    ("lm head", ("compute_logits",)),
    ("native paged decode attention", ("paged_decode_native",)),
    ("extend attention (the torch path)", ("paged_attention_planned",)),
    ("linear: MKL re-packing the weight", ("sgemm_scopy",)),
    ("linear: GEMM compute", ("Linear.forward",)),
    ("elementwise: norm, rope, silu, kv store", ("rms_norm", "silu", "_rotate", "apply_rope", "store_kv")),
)


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one `frame;frame;...;leaf count` line per distinct stack, the thread first."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def _thread_is(frames: list[str], name: str) -> bool:
    return frames[0].endswith(f": {name}")


def step_phase(frames: list[str]) -> str:
    stack = ";".join(frames)
    if any(g in stack for g in _GIL):
        return "waiting for the GIL"
    for phase, marker in (("forward", "ModelRunner.forward"), ("process", ".process ("),
                          ("schedule", ".schedule (")):
        if marker in stack:
            return phase
    return "idle" if any(w in stack for w in _WAITING) else "other"


def forward_cost(frames: list[str]) -> str:
    stack = ";".join(frames)
    for name, markers in FORWARD_COSTS:
        if any(m in stack for m in markers):
            return name
    return "other: python, embedding, attention plan, batch building"


def shares(samples: list[tuple[list[str], int]]) -> dict:
    """Per-thread shares of the samples (each thread is sampled at every tick, busy or not)."""
    step, forward, loop = Counter(), Counter(), Counter()
    for frames, n in samples:
        if _thread_is(frames, STEP_THREAD):
            phase = step_phase(frames)
            step[phase] += n
            if phase == "forward":
                forward[forward_cost(frames)] += n
        elif _thread_is(frames, EVENT_LOOP_THREAD):
            loop["idle" if any(w in ";".join(frames) for w in _WAITING) else "busy"] += n

    def pct(counter: Counter) -> dict[str, float]:
        total = sum(counter.values())
        return {k: round(100 * v / total, 1) for k, v in counter.most_common()} if total else {}

    return {"step_thread_samples": sum(step.values()), "step_thread_pct": pct(step),
            "forward_samples": sum(forward.values()), "forward_pct": pct(forward),
            "event_loop_busy_pct": pct(loop).get("busy", 0.0)}


def run(args: argparse.Namespace) -> dict:
    from loadtests.experiments.peer import _default_model, build_requests, duet_limits, duet_threads, figures
    from loadtests.load.client import run_benchmark
    from loadtests.load.report import summarize
    from loadtests.load.workloads import TokenSource
    from loadtests.stack.serving import ServingStack

    beside = Path(sys.executable).parent / "py-spy"  # pip install py-spy into this virtualenv puts it here
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("profile_served: py-spy not found beside this python or on PATH (pip install py-spy)")
    model = Path(args.model) if args.model else _default_model(lambda line: print(line, file=sys.stderr))
    src = TokenSource.from_model_dir(model)
    out = Path(args.out or tempfile.mkdtemp(prefix="duet-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{args.engine}-{args.load}.txt"
    with ServingStack(model, [args.engine], {}, duet_limits(duet_threads()),
                      log_dir=out / "logs") as stack:
        run_benchmark(stack.url, model.name, build_requests(args.load, src, 2, "warmup"),
                      concurrency=args.concurrency, progress=False)
        spy = subprocess.Popen([py_spy, "record", "-p", str(stack.supervisor.pid(f"{args.engine}-0")),
                                "--rate", str(args.rate), "--native", "--idle", "--threads", "--format", "raw",
                                "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches before the first request
        records = run_benchmark(stack.url, model.name, build_requests(args.load, src, args.num_prompts, "measure"),
                                concurrency=args.concurrency, progress=False)
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=120)
    return {"engine": args.engine, "load": args.load, "num_prompts": args.num_prompts, "rate_hz": args.rate,
            "raw_profile": str(raw), "figures_while_sampled": figures(summarize(records)),
            **shares(parse_raw(raw.read_text()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.profiles.profile_served", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("paged", "prefix"), default="paged")
    p.add_argument("--load", choices=("shared_prefix", "unique"), default="shared_prefix")
    p.add_argument("--model", default=None, help="model directory (default: the pulled SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--out", default=None, help="keep the raw profile and the logs here (default: a temp dir)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.concurrency < 1 or args.rate < 1:
        p.error("--num-prompts, --concurrency and --rate must be at least 1")
    result = run(args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
