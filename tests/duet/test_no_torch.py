"""The duet package is what a gateway pod imports: it must not pull in torch or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_duet_modules_do_not_import_torch() -> None:
    code = (
        "import sys, duet.model_dir, duet.model_make, duet.tokenizer, duet.detokenizer, duet.hashing,"
        " duet.balancer, duet.scale_out, duet.pool_scaler, duet.healthcheck,"
        " duet.registry, duet.cli, duet.engine_config, duet.sim_worker;"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
