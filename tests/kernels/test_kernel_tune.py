"""`python -m engine_core.kernels.tune extend`: every tile it sweeps gives the reference's output on shapes where
the tile is larger than some sequences (the interpreter checks correctness and bounds, not speed), a tile the
kernel cannot run is rejected before launch, and the command writes its report as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_core.kernels import tune
from engine_core.kernels._jit import interpreting

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
# the GPU tiles are for bf16 (fp32 tiles of 128 x 128 may not fit in shared memory); the interpreter is exact in fp32
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def test_every_swept_tile_matches_the_reference_on_ragged_tiny_shapes():
    tiles = tune.INTERPRETER_TILES + (tune.GPU_TILES[0],)
    rows = tune.sweep_extend(tiles, tune.TINY_SHAPES, DTYPE, timed=False, device=DEVICE)
    assert [r["status"] for r in rows] == ["passed"] * len(tiles), rows
    atol = tune.TOLERANCE[DTYPE][0]
    for r in rows:
        assert set(r["shapes"]) == {s.name for s in tune.TINY_SHAPES}
        assert all(s["max_abs_err"] <= 2 * atol for s in r["shapes"].values())


def test_a_tile_the_kernel_cannot_run_is_rejected_and_the_rest_still_run():
    rows = tune.sweep_extend(((16, 8, 4, 2), (16, 16, 4, 2)), tune.TINY_SHAPES[:1], DTYPE, timed=False,
                             device=DEVICE)
    assert rows[0]["status"] == "rejected" and "BLOCK_N=8" in rows[0]["reason"] and rows[0]["shapes"] == {}
    assert rows[1]["status"] == "passed"


def test_the_flop_count_is_the_benchs_causal_count():
    # one sequence of 4 new tokens after 2 cached: it attends to 3 + 4 + 5 + 6 = 18 keys
    assert tune.Shape("s", (2,), (4,), 16, 2, 1, 8).flops == 4 * 18 * 2 * 8


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the command sweeps the H200 shapes, timed (make gpu-check)")
def test_the_command_runs_itself_under_the_interpreter_and_writes_json(tmp_path):
    out = tmp_path / "tune.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it must turn the interpreter on itself
    proc = subprocess.run([sys.executable, "-m", "engine_core.kernels.tune", "extend", "--tiles",
                           "16x16x4x2,8x16x4x2", "--out", str(out)], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["mode"].startswith("interpreter") and "best" not in report  # no timing claims without a GPU
    assert [(r["tile"], r["status"]) for r in report["tiles"]] == [([16, 16, 4, 2], "passed"),
                                                                  ([8, 16, 4, 2], "rejected")]
    assert report["default_tile"] == {"gpu": [128, 128, 8, 2], "interpreter": [16, 16, 4, 2]}
    assert "16x16x4x2" in proc.stdout and "rejected" in proc.stdout
