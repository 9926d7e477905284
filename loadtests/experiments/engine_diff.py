"""`duet bench diff`: the same requests on engine_paged and on engine_prefix, and where the answers differ.

Each request body (an OpenAI chat or completions body, one per line of a JSONL file: a sample of a team's
traffic) is sent through the gateway twice, pinned to each kind by the `x-duet-variant` header over a
routing config with one variant per kind (`ROUTING`). The two answers are compared field by field: the
text and finish reason of every choice, the token logprobs (within `LOGPROB_ATOL`: both kinds run the same
fp32 model code, but batch shapes and attention kernels differ, so sums are ordered differently), and the
usage counts. Cached prompt tokens are shown, not counted as a difference: caching is what the kinds do
differently by design. A request one kind refuses and the other serves (n > 1 is paged-only, structured
output prefix-only: gateway.routing.policy's capability step) is listed as a `capability` difference with the
refusal's message, never dropped. Latency is reported as a distribution per kind.

`compare` is pure (two `Answer`s in, `Difference`s out), so it is tested without a stack.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

KINDS = ("paged", "prefix")
# one variant per kind, so that `x-duet-variant: paged|prefix` forces the engine kind
ROUTING = {"variants": [{"name": kind, "weight": 1, "pools": [{"engine_kind": kind}]} for kind in KINDS]}
LOGPROB_ATOL = 1e-3  # fp32 logprobs of one model through two batchings; observed differences are ~1e-6


@dataclass(frozen=True)
class Answer:
    kind: str  # the kind it was pinned to
    status: int
    body: dict
    latency_s: float
    served_by: str | None  # the gateway's x-duet-engine header


@dataclass(frozen=True)
class Difference:
    field: str  # capability, status, pinning, choices, text, finish_reason, logprobs, usage
    detail: str


def endpoint_of(body: dict) -> str:
    if "messages" in body:
        return "/v1/chat/completions"
    if "prompt" in body:
        return "/v1/completions"
    raise ValueError("a request body needs `messages` (chat) or `prompt` (completions)")


def pin_headers(kind: str, admin_key: str | None) -> dict[str, str]:
    headers = {"x-duet-variant": kind}
    if admin_key:
        headers["x-duet-admin-key"] = admin_key  # the override is an operator tool
    return headers


def ask(client: httpx.Client, body: dict, kind: str, admin_key: str | None) -> Answer:
    body = {**body, "stream": False}
    start = time.perf_counter()
    r = client.post(endpoint_of(body), json=body, headers=pin_headers(kind, admin_key))
    latency = time.perf_counter() - start
    try:
        parsed = r.json()
    except ValueError:
        parsed = {"error": {"message": r.text[:200]}}
    return Answer(kind, r.status_code, parsed, latency, r.headers.get("x-duet-engine"))


def _text(choice: dict) -> str:
    if "message" in choice:
        m = choice["message"]
        return (m.get("content") or "") + json.dumps(m.get("tool_calls") or [], sort_keys=True)
    return choice.get("text") or ""


def _logprobs(choice: dict) -> list[tuple[str, float]] | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:  # chat
        return [(t["token"], t["logprob"]) for t in lp["content"] or ()]
    return list(zip(lp.get("tokens") or (), lp.get("token_logprobs") or ()))


def _error(a: Answer) -> str:
    return str((a.body.get("error") or {}).get("message", a.body))[:160]


def compare(paged: Answer, prefix: Answer, atol: float = LOGPROB_ATOL) -> list[Difference]:
    """Where two answers to one request differ (empty: the client could not tell the kinds apart)."""
    out = []
    for a in (paged, prefix):
        if a.status == 200 and a.served_by != a.kind:
            out.append(Difference("pinning", f"pinned to {a.kind} but served by {a.served_by} "
                                             "(does the gateway have one variant per kind, and the admin key?)"))
    if paged.status != prefix.status:
        ok = [a for a in (paged, prefix) if a.status == 200]
        if len(ok) == 1:
            other = prefix if ok[0] is paged else paged
            out.append(Difference("capability", f"only {ok[0].kind} serves it; {other.kind}: {other.status} "
                                                f"{_error(other)}"))
        else:
            out.append(Difference("status", f"paged {paged.status}, prefix {prefix.status}"))
        return out
    if paged.status != 200:
        return out  # both refuse it alike
    a_choices = sorted(paged.body.get("choices", ()), key=lambda c: c.get("index", 0))
    b_choices = sorted(prefix.body.get("choices", ()), key=lambda c: c.get("index", 0))
    if len(a_choices) != len(b_choices):
        out.append(Difference("choices", f"paged {len(a_choices)}, prefix {len(b_choices)}"))
    for ca, cb in zip(a_choices, b_choices):
        i = ca.get("index", 0)
        if _text(ca) != _text(cb):
            out.append(Difference("text", f"choice {i}: paged {_text(ca)[:60]!r} / prefix {_text(cb)[:60]!r}"))
        if ca.get("finish_reason") != cb.get("finish_reason"):
            out.append(Difference("finish_reason", f"choice {i}: paged {ca.get('finish_reason')}, "
                                                   f"prefix {cb.get('finish_reason')}"))
        la, lb = _logprobs(ca), _logprobs(cb)
        if (la is None) != (lb is None):
            out.append(Difference("logprobs", f"choice {i}: only {'paged' if la else 'prefix'} returned logprobs"))
        elif la is not None:
            if [t for t, _ in la] != [t for t, _ in lb]:
                out.append(Difference("logprobs", f"choice {i}: different tokens"))
            else:
                worst = max((abs(x - y) for (_, x), (_, y) in zip(la, lb)), default=0.0)
                if worst > atol:
                    out.append(Difference("logprobs", f"choice {i}: max |delta| {worst:.2e} > {atol:.0e}"))
    ua, ub = paged.body.get("usage") or {}, prefix.body.get("usage") or {}
    for key in ("prompt_tokens", "completion_tokens"):
        if ua.get(key) != ub.get(key):
            out.append(Difference("usage", f"{key}: paged {ua.get(key)}, prefix {ub.get(key)}"))
    return out


def cached_tokens(a: Answer) -> int | None:
    details = (a.body.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run_diff(url: str, bodies: list[dict], admin_key: str | None = None, model: str | None = None,
             repeats: int = 1, timeout_s: float = 300.0) -> dict:
    """Every body on both kinds (`repeats` times each, for the latency distribution; the first answers
    are compared) and the report: one row per request, the same/different counts, latency per kind."""
    rows, latencies = [], {k: [] for k in KINDS}
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        for i, body in enumerate(bodies):
            if model is not None:
                body = {**body, "model": model}
            answers = {}
            for kind in KINDS:
                for r in range(max(1, repeats)):
                    a = ask(client, body, kind, admin_key)
                    answers.setdefault(kind, a)
                    if a.status == 200:
                        latencies[kind].append(a.latency_s)
            diffs = compare(answers["paged"], answers["prefix"])
            rows.append({"index": i, "endpoint": endpoint_of(body),
                         "differences": [{"field": d.field, "detail": d.detail} for d in diffs],
                         "status": {k: answers[k].status for k in KINDS},
                         "latency_s": {k: round(answers[k].latency_s, 4) for k in KINDS},
                         "cached_tokens": {k: cached_tokens(answers[k]) for k in KINDS}})
    fields: dict[str, int] = {}
    for row in rows:
        for d in {d["field"] for d in row["differences"]}:
            fields[d] = fields.get(d, 0) + 1
    return {"requests": len(rows), "same": sum(1 for r in rows if not r["differences"]), "by_field": fields,
            "latency_s": {k: {"n": len(v), "p50": _quantile(v, 0.5), "p90": _quantile(v, 0.9),
                              "p99": _quantile(v, 0.99), "mean": statistics.fmean(v) if v else float("nan")}
                          for k, v in latencies.items()},
            "rows": rows}


def load_requests(path: str | Path, limit: int | None = None) -> list[dict]:
    bodies = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            body = json.loads(line)
            endpoint_of(body)  # a clear error for a line that is neither kind of body
            bodies.append(body)
        if limit is not None and len(bodies) >= limit:
            break
    return bodies


def run_local(requests: list[dict], model: str | Path, repeats: int = 1, log_dir: Path | None = None) -> dict:
    """One worker of each kind on `model` behind a gateway with `ROUTING`, then `run_diff`."""
    from loadtests.experiments.stack import ADMIN_KEY, ServingStack

    with ServingStack(model, list(KINDS), ROUTING, log_dir=log_dir) as stack:
        return run_diff(stack.url, requests, ADMIN_KEY, model=Path(model).name, repeats=repeats)


def format_report(report: dict) -> str:
    lines = [f"{report['same']} of {report['requests']} requests answered alike on paged and prefix"]
    if report["by_field"]:
        lines.append("differing: " + ", ".join(f"{f} {n}" for f, n in sorted(report["by_field"].items())))
    lines += ["", "| # | endpoint | differences | cached paged/prefix | latency paged/prefix (s) |",
              "|---|---|---|---|---|"]
    for r in report["rows"]:
        diffs = "; ".join(f"{d['field']}: {d['detail']}" for d in r["differences"]) or "same"
        c, lat = r["cached_tokens"], r["latency_s"]
        lines.append(f"| {r['index']} | {r['endpoint']} | {diffs} | {c['paged']}/{c['prefix']} | "
                     f"{lat['paged']:.3f}/{lat['prefix']:.3f} |")
    lines += ["", "| kind | answered | p50 s | p90 s | p99 s | mean s |", "|---|---|---|---|---|---|"]
    for kind, d in report["latency_s"].items():
        lines.append(f"| {kind} | {d['n']} | {d['p50']:.3f} | {d['p90']:.3f} | {d['p99']:.3f} | {d['mean']:.3f} |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    """`duet bench diff` (argparse only; the run imports lazily)."""
    p = sub.add_parser(
        "diff", help="run a sample of requests on both engine kinds and report where the answers differ",
        description="Sends every request of a JSONL file of OpenAI chat/completions bodies to engine_paged and "
        "to engine_prefix (pinned by x-duet-variant) and reports where the answers differ: text, finish "
        "reason, logprobs, usage, a capability only one kind has; and the latency distribution per kind. "
        "Without --url it starts its own stack (one worker of each kind on --model).")
    p.add_argument("--requests", required=True, help="JSONL, one OpenAI request body per line")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--model", default=None, help="model directory for the local stack (default: the tiny model)")
    p.add_argument("--url", default=None, help="a running gateway whose routing has the variants 'paged' and "
                   "'prefix', one pool of each kind (see loadtests/experiments/engine_diff.py ROUTING)")
    p.add_argument("--admin-key", default=None, help="with --url: the gateway's admin key (the pin needs it)")
    p.add_argument("--served-model-name", default=None, help="with --url: send this model name instead")
    p.add_argument("--repeats", type=int, default=1, help="sends per request and kind (latency distribution)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import os
    import sys

    bodies = load_requests(args.requests, args.limit)
    if args.url:
        admin_key = args.admin_key or os.environ.get("DUET_ADMIN_KEY")
        report = run_diff(args.url, bodies, admin_key, model=args.served_model_name, repeats=args.repeats)
    else:
        from duet.model_make import default_model_dir
        from loadtests.experiments.stack import StackError

        try:
            report = run_local(bodies, Path(args.model) if args.model else default_model_dir(), args.repeats)
        except StackError as e:
            print(f"duet bench diff: {e}", file=sys.stderr)
            return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
