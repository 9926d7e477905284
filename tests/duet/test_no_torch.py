"""The duet package is what a gateway pod imports: it must not pull in torch or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_duet_modules_do_not_import_torch() -> None:
    code = (
        "import sys, duet.model_dir, duet.model_make, duet.tokenizer, duet.detokenizer, duet.hashing,"
        " duet.balancer, duet.scale_out, duet.pool_scaler, duet.healthcheck,"
        " duet.registry, duet.cli, duet.engine_config, duet.sim_worker, duet.sse;"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_duet_up_and_its_launcher_import_neither_torch_nor_loadtests() -> None:
    """`duet up` starts every stack through duet.launcher; the benchmarks use the same launcher, never the
    other way round (a serving path must not need the load tests installed)."""
    code = (
        "import sys, duet.up, duet.launcher, duet.supervisor, duet.pool_manager;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton', 'loadtests')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
