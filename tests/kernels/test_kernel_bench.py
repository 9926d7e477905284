"""The kernel benchmark script runs on a machine without a GPU and says what it did not measure."""

from __future__ import annotations

import json

from engine_core.kernels import bench


def test_cpu_report_has_reference_timings_and_says_triton_was_not_run():
    report = bench.run(cpu_only=True)
    assert report["device"] == "cpu"
    assert report["triton"] == "not run: no CUDA device"
    kernels = {r["kernel"] for r in report["results"]}
    assert {"paged_decode_attention", "extend_attention", "fused_add_rms_norm", "apply_rope", "silu_and_mul",
            "store_kv"} <= kernels
    for row in report["results"]:
        assert row["torch_ms"] > 0 and row["torch_rate"] > 0 and "triton_ms" not in row
    json.dumps(report)  # the --json output is one JSON document
