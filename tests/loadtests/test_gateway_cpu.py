"""loadtests/experiments/gateway_cpu.py end to end, small: the real gateway in front of two fake vLLM servers
(loadtests/stack/fake_vllm.py) serves every request with every token, and each phase reports a CPU figure."""

from __future__ import annotations

from duet.model_make import default_model_dir
from loadtests.experiments.gateway_cpu import measure


def test_the_gateway_serves_fake_vllm_servers_and_the_phases_report_cpu(tmp_path):
    out = measure(default_model_dir(), servers=2, requests=6, full_requests=8, rate=4.0, concurrency=4, idle_s=1.0,
                  token_ms=2.0, max_prompt_tokens=256, max_tokens=4, log_dir=tmp_path, progress=lambda _: None)
    for phase, n in (("rate", 6), ("full", 8)):
        assert out[phase]["errors"] == 0, out
        # every token of every stream (the fakes answer max_tokens; the trace asks fewer than 4 of some)
        assert out[phase]["output_tokens"] == out[phase]["max_tokens"] >= 3 * n
    # the kernel counts CPU in 10 ms ticks: 8 fast requests can fall within one, 1.5 s of paced requests cannot
    assert out["rate"]["cpu_ms_per_request"] > 0 and isinstance(out["full"]["cpu_ms_per_request"], float)


def test_several_output_lengths_and_a_checkout_give_exact_tokens_medians_and_ratios(tmp_path):
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[2])  # this checkout, named twice: an A/B of the same code
    out = measure(default_model_dir(), servers=2, requests=3, full_requests=4, rate=4.0, concurrency=4, idle_s=0.5,
                  token_ms=2.0, max_prompt_tokens=256, max_tokens=[2, 5], log_dir=tmp_path, progress=lambda _: None,
                  rounds=1, checkouts=[here, here + "/"])
    row = out["rounds"][0][here]
    for n in (2, 5):
        for phase, count in (("rate", 3), ("full", 4)):
            figures = row[f"{phase}@{n}"]
            assert figures["errors"] == 0, figures
            assert figures["output_tokens"] == figures["max_tokens"] == n * count  # exactly n tokens each
    # (4 fast requests can fall within one 10 ms CPU tick: the figure may be 0, its key may not be missing)
    assert set(out["medians"]) == {here, here + "/"} and isinstance(out["medians"][here]["full@5"], float)
    assert len(out["ratios"][here + "/"]["rate@2"]) == 1
