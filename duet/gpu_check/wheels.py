"""`python -m duet.gpu_check.wheels [--dest DIR] [--python-version 3.12] [PACKAGE ...]` (`make gpu-wheels`):
the wheels a GPU image may lack, for that machine's Python, into a folder to carry there (a lent GPU reaches no
package index). By default the packages of environment.CARRIED (the gRPC runtime and protobuf the stubs need),
at the versions the check requires; more by name when a check's environment record lists them as missing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from duet.gpu_check.environment import CARRIED, ROOT, Problem, install_specs, project_needs


def wanted_specs(names: list[str]) -> list[str]:
    """pip requirement strings for `names`: each with every need the check has of it combined; a name the
    check has no need of, as given."""
    needs = [n for n in project_needs() if n.name in names]
    known = {n.name for n in needs}
    return install_specs([Problem(n, None) for n in needs]) + [n for n in names if n not in known]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duet.gpu_check.wheels", description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=list(CARRIED), help=f"default: {' '.join(CARRIED)}")
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (its image: 3.12)")
    parser.add_argument("--platform", default="manylinux2014_x86_64")
    args = parser.parse_args(argv)
    specs = wanted_specs(args.packages)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", args.python_version, "--platform", args.platform, "--implementation", "cp",
           "-d", str(args.dest), *specs]
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, check=False).returncode
    if rc == 0:
        size = sum(f.stat().st_size for f in args.dest.glob("*.whl"))
        print(f"{args.dest}: {len(list(args.dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB; "
              f"on the GPU machine: make gpu-check GPU_WHEELS={args.dest}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
