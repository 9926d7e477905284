"""`python -m engine_core.step_trace DIR`: a worker's steps summed by kind, which says where a scheduler put the
prompts' work (docs/benchmarks.md reads it for engine_paged against engine_prefix)."""

from __future__ import annotations

import json

from engine_core.step_trace import main, step_kinds

RECORDS = [  # chunks: [new tokens, tokens already in pages, logits rows]
    {"t": 0.0, "step_s": 0.50, "forward_s": 0.49, "chunks": [[512, 0, 1], [300, 0, 1]]},  # prefill only
    {"t": 1.0, "step_s": 0.03, "forward_s": 0.02, "chunks": [[1, 512, 1], [1, 300, 1]]},  # decode
    {"t": 2.0, "step_s": 0.05, "forward_s": 0.04, "chunks": [[1, 513, 1], [1, 301, 1]]},  # decode
    {"t": 3.0, "step_s": 0.02, "forward_s": 0.01, "chunks": [[1, 514, 1]]},  # decode
    {"t": 4.0, "step_s": 0.20, "forward_s": 0.19, "chunks": [[1, 515, 1], [256, 0, 0]]},  # mixed
]


def test_steps_are_summed_by_kind_with_their_prompt_tokens_and_decodes():
    kinds = step_kinds(RECORDS)
    assert list(kinds) == ["decode", "mixed", "prefill"]
    assert kinds["decode"]["steps"] == 3
    assert abs(kinds["decode"]["seconds"] - 0.10) < 1e-9
    assert kinds["decode"]["median_ms"] == 30.0
    assert abs(kinds["decode"]["p99_ms"] - 49.6) < 1e-9  # 30 ms to 50 ms, 98% of the way (interpolated)
    assert kinds["decode"]["decoding"] == 5 / 3
    assert kinds["mixed"] == {"steps": 1, "seconds": 0.20, "median_ms": 200.0, "p99_ms": 200.0, "prompt_tokens": 256,
                              "decoding": 1}
    assert kinds["prefill"]["prompt_tokens"] == 812
    assert kinds["prefill"]["decoding"] == 0


def test_the_command_prints_each_workers_kinds_and_says_when_there_is_no_trace(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no steps-*.jsonl" in capsys.readouterr().out
    (tmp_path / "steps-42.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker 42: 5 steps, 0.8 s" in out
    assert "mixed         1 steps     0.2 s  median   200.0 ms  p99   200.0 ms  prompt tokens    256" in out
