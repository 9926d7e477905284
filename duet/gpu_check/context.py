"""What every step of the GPU check is given: where the repository and the output folder are, the machine as
probed (torch, CUDA, devices), the options, the time left, and the environment its commands run in."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Context:
    root: Path  # the repository: commands run here, with it first on PYTHONPATH
    out: Path  # the output folder: NN-step.json files, logs/, data files
    machine: dict  # environment.probe_torch(): torch, triton, cuda_available, cuda_version, devices
    deadline: float  # time.monotonic() by which the whole check should be done
    wheels: Path | None = None  # a folder of wheels for what the machine lacks
    model: str | None = None  # the model `duet up` serves (default: see serve.py)
    cpu_serve: bool = False  # run the serve probes without CUDA too (tiny model)
    python: str = sys.executable

    @property
    def cuda(self) -> bool:
        return bool(self.machine.get("cuda_available"))

    @property
    def gpus(self) -> int:
        return len(self.machine.get("devices") or ())

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, unset: tuple[str, ...] = (), **extra: str) -> dict:
        """The environment for a step's command: this one, the repository first on PYTHONPATH, output unbuffered."""
        env = {k: v for k, v in os.environ.items() if k not in unset}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def rel(self, path: Path) -> str:
        """A path as the records give it: relative to the output folder when inside it."""
        try:
            return str(path.relative_to(self.out))
        except ValueError:
            return str(path)
