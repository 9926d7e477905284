"""`python -m loadtests.experiments.doc_flood [--users 24] [--json]`: the load that once turned a busy fleet
into a refused one (issue 21), replayed as a new user would meet it.

`duet up` with its defaults (the default real model, one paged and one prefix worker), then `--users` clients
with the official openai SDK, each sending at the same moment a ~2,750-token English document (slices of the
standard library's pydoc help topics, so no download) to summarise. Printed: how many were answered, the
errors by status, and the first-token and end-to-end latency percentiles. It is a correctness drill with a
real model on this machine's cores, not a speed figure: with the old first-token watchdog 13 of 24 got
503 after 120 s; now every request must be answered (or refused at once with 429 when a queue bound is set).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

DOC_WORDS = 2000  # about 2,750 SmolLM2 tokens of this text
ROOT = Path(__file__).resolve().parents[2]


def documents(n: int) -> list[str]:
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    return [" ".join(words[i * DOC_WORDS:(i + 1) * DOC_WORDS]) for i in range(n)]


def _start_up(port: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "up", "--port", str(port), *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # the API line means every worker is healthy
        print(line, end="", file=sys.stderr)
        if line.startswith("API:"):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split()[1]
    raise SystemExit(f"duet up exited ({proc.wait()}) before it was ready")


def _ask(client, model: str, doc: str, out: dict) -> None:
    import openai

    t0 = time.monotonic()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Summarise this document:\n\n" + doc}],
            max_tokens=64, temperature=0, stream=True)
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
        out.update(status=200, ttft_s=first, e2e_s=time.monotonic() - t0)
    except openai.APIStatusError as e:
        out.update(status=e.status_code, after_s=time.monotonic() - t0, error=str(e)[:200])
    except openai.APIError as e:
        out.update(status="transport", after_s=time.monotonic() - t0, error=str(e)[:200])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


def run(users: int, port: int, up_flags: list[str]) -> dict:
    import openai

    from duet.launcher import free_port

    proc, api = _start_up(port or free_port(), up_flags)
    try:
        client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        results = [{} for _ in range(users)]
        threads = [threading.Thread(target=_ask, args=(client, model, d, r))
                   for d, r in zip(documents(users), results, strict=True)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ok = [r for r in results if r.get("status") == 200]
    errors: dict[str, int] = {}
    for r in results:
        if r.get("status") != 200:
            errors[str(r.get("status"))] = errors.get(str(r.get("status")), 0) + 1
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    e2e = [r["e2e_s"] for r in ok]
    return {"users": users, "answered": len(ok), "errors": errors, "wall_s": round(wall, 1),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_max_s": _pct(ttft, 1.0), "e2e_p50_s": _pct(e2e, 0.5),
            "e2e_max_s": _pct(e2e, 1.0), "up_flags": up_flags,
            "sample_error": next((r.get("error") for r in results if r.get("status") != 200), None)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.experiments.doc_flood", description=__doc__)
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("up_flags", nargs="*", help="extra `duet up` flags (after --), e.g. -- --model DIR")
    args = p.parse_args(argv)
    report = run(args.users, args.port, args.up_flags)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if report["answered"] + report["errors"].get("429", 0) == args.users else 1


if __name__ == "__main__":
    sys.exit(main())
