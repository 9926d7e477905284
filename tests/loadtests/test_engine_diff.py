"""`duet bench diff`: the comparison of two answers (pure), and the command end to end on its own stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtests.experiments.engine_diff import Answer, compare

ROOT = Path(__file__).resolve().parents[2]


def _chat(text: str, finish: str = "stop", logprobs=None, completion_tokens: int = 3) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "top_logprobs": []} for t, lp in logprobs]}
    return {"choices": [choice], "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                                           "prompt_tokens_details": {"cached_tokens": 0}}}


def _pair(paged: dict, prefix: dict, status=(200, 200)) -> tuple[Answer, Answer]:
    return (Answer("paged", status[0], paged, 0.1, "paged"), Answer("prefix", status[1], prefix, 0.1, "prefix"))


def test_alike_answers_have_no_difference_even_with_other_cached_tokens():
    a = _chat("red, green", logprobs=[("red", -0.5), (",", -0.25)])
    b = _chat("red, green", logprobs=[("red", -0.5000004), (",", -0.25)])
    b["usage"]["prompt_tokens_details"]["cached_tokens"] = 8  # caching differs by design
    assert compare(*_pair(a, b)) == []


def test_text_finish_logprobs_and_usage_differences_are_each_named():
    a = _chat("red", logprobs=[("red", -0.5)], completion_tokens=1)
    b = _chat("blue", finish="length", logprobs=[("blue", -0.9)], completion_tokens=2)
    fields = [d.field for d in compare(*_pair(a, b))]
    assert fields == ["text", "finish_reason", "logprobs", "usage"]
    drift = _chat("red", logprobs=[("red", -0.6)], completion_tokens=1)
    (d,) = compare(*_pair(a, drift))
    assert d.field == "logprobs" and "max |delta| 1.00e-01" in d.detail


def test_a_request_one_kind_refuses_is_a_capability_difference():
    refusal = {"error": {"message": "variant 'prefix' has no healthy worker able to serve this request"}}
    (d,) = compare(*_pair(_chat("x"), refusal, status=(200, 503)))
    assert d.field == "capability" and d.detail.startswith("only paged serves it; prefix: 503 variant 'prefix'")
    assert compare(*_pair(refusal, refusal, status=(400, 400))) == []  # both refuse alike


def test_an_unpinned_answer_is_reported_not_compared_silently():
    paged, prefix = _pair(_chat("x"), _chat("x"))
    prefix = Answer("prefix", 200, prefix.body, 0.1, "paged")  # the gateway ignored the pin
    assert [d.field for d in compare(paged, prefix)] == ["pinning"]


def test_the_command_starts_its_stack_and_prints_the_report(tmp_path):
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(json.dumps(b) for b in [
        {"model": "whatever", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0},
        {"model": "whatever", "prompt": "abc", "max_tokens": 6, "n": 2, "seed": 1},
    ]) + "\n")
    out = subprocess.run([sys.executable, "-m", "duet.cli", "bench", "diff", "--requests", str(sample), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["requests"] == 2 and report["same"] == 1
    assert [d["field"] for d in report["rows"][1]["differences"]] == ["capability"]
    assert report["rows"][0]["status"] == {"paged": 200, "prefix": 200}
