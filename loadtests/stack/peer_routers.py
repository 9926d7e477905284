"""The routers a team would install instead of Duet's gateway, each from PyPI into a virtualenv of its own, and
the process that runs one (or Duet's gateway) in front of a set of OpenAI-compatible engine servers.

    PEERS                      package, version and policies of sglang-router, smg and vllm-router
    ROUTERS                    every contender `duet bench routers` knows: "duet" and "<package>:<policy>"
    ensure_installed(peer)     the peer's virtualenv under Duet's cache dir (pip, once; a marker file written
                               last says the install finished), as loadtests/stack/vllm_server.py makes vLLM's
    RouterProcess(...)         a context manager: the router on a free port, its log in a file, ready once
                               `/v1/models` (or `/health`) answers; `cpu_seconds()` is its process tree's CPU time

Each peer runs with its own defaults except what the comparison needs: the servers' URLs, the policy, and for
vllm-router's kv_aware the servers' KV-event endpoints with the model identity and KV block size they hash with
(its `--kv-event-model` and `--kv-event-block-size`: without them the events name another model and block size
than the prompts it hashes, and nothing matches). Their retries stay at their defaults: a router that re-sends
requests under load shows it as retry amplification in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from duet.cache_dir import cache_root
from loadtests.stack import peer_venv
from loadtests.stack.server_process import ServerProcess

DUET = "duet"


@dataclass(frozen=True)
class Peer:
    package: str
    version: str
    module: str  # `python -m <module>` starts the router
    policies: tuple[str, ...]


PEERS = {
    "sglang-router": Peer("sglang-router", "0.3.2", "sglang_router.launch_router", ("cache_aware",)),
    "smg": Peer("smg", "1.13.0", "smg.launch_router", ("cache_aware",)),
    "vllm-router": Peer("vllm-router", "0.1.17", "vllm_router.launch_router",
                        ("round_robin", "cache_aware", "kv_aware")),
}
ROUTERS = (DUET, *(f"{name}:{policy}" for name, peer in PEERS.items() for policy in peer.policies))


def parse_router(name: str) -> tuple[Peer | None, str | None]:
    """"duet" -> (None, None); "vllm-router:kv_aware" -> (the peer, "kv_aware"); ValueError otherwise."""
    if name == DUET:
        return None, None
    package, _, policy = name.partition(":")
    peer = PEERS.get(package)
    if peer is None or policy not in peer.policies:
        raise ValueError(f"unknown router {name!r}: choose from {', '.join(ROUTERS)}")
    return peer, policy


def venv_dir(peer: Peer) -> Path:
    return cache_root() / f"peer-router-{peer.package}-{peer.version}"


def installed(peer: Peer) -> bool:
    return peer_venv.installed(venv_dir(peer))


def ensure_installed(peer: Peer, progress=print) -> Path:
    """The peer's virtualenv, installed on first use (seconds: each is one Rust wheel and a few packages)."""
    return peer_venv.install_venv(venv_dir(peer), f"{peer.package}=={peer.version}", progress)


@dataclass(frozen=True)
class KvSource:
    """One engine server's KV-event publisher, for vllm-router's kv_aware."""

    worker_url: str
    endpoint: str  # tcp://host:port
    replay_endpoint: str | None = None


def peer_argv(peer: Peer, policy: str, port: int, urls: list[str], *, model: str | None = None,
              block_size: int | None = None, kv_sources: tuple[KvSource, ...] = ()) -> list[str]:
    argv = [str(venv_dir(peer) / "bin" / "python"), "-m", peer.module, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", policy]
    if peer.package == "vllm-router" and policy == "kv_aware" and kv_sources:
        for s in kv_sources:
            argv += ["--kv-event-source", f"{s.worker_url}={s.endpoint}"]
            if s.replay_endpoint:
                argv += ["--kv-event-replay-source", f"{s.worker_url}={s.replay_endpoint}"]
        if model:
            argv += ["--kv-event-model", model]
        if block_size:
            argv += ["--kv-event-block-size", str(block_size)]
    return argv


class RouterProcess(ServerProcess):
    """A router process (`argv`) on `port`, ready once /v1/models or /health answers."""

    def cpu_seconds(self) -> float:
        """User + system CPU time of the router's process and its children so far."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
