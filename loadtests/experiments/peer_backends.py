"""The two `duet bench peer` stacks with vLLM behind Duet's gateway (gateway/http_backend.py):

    duet_over_vllm          Duet's gateway in front of one vLLM server (its only pool): the gateway's overhead
                            on a real engine, read against the `vllm` side (vLLM alone) of the same run;
    vllm_paged_duet_prefix  vLLM as the paged pool plus one Duet prefix worker, Duet's routing between them.

Each starts its own vLLM server (the same flags as the `vllm` side, plus what the gateway needs of it:
`peer_vllm.backend_args`, KV events included), so no stack sees a cache another one warmed. Their figures
join the peer JSON as sides beside the Duet engine kinds, with the same ratios against vLLM alone.
"""

from __future__ import annotations

from pathlib import Path

STACKS = ("duet_over_vllm", "vllm_paged_duet_prefix")


def backend_entry(server, kv_port: int, replay_port: int) -> dict:
    """The gateway config's `backends` entry for a peer_vllm.VllmServer started with backend_args()."""
    return {"engine": "vllm", "url": server.url, "kind": "paged",
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv_port}",
                          "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}}


def measure_stack(name: str, venv: Path, model: Path, served_name: str, log_dir: Path, vllm_limits: dict,
                  duet_limits, measure, progress) -> dict[str, dict]:
    """{load: figures} of one stack; `measure(url)` runs the loads against a gateway URL."""
    from duet.launcher import free_port
    from loadtests.experiments import peer_vllm
    from loadtests.experiments.stack import ServingStack

    if name not in STACKS:
        raise ValueError(f"unknown stack {name!r}; choose from {', '.join(STACKS)}")
    kinds = [] if name == "duet_over_vllm" else ["prefix"]
    stack_dir = log_dir / name
    stack_dir.mkdir(parents=True, exist_ok=True)
    kv_port, replay_port = free_port(), free_port()
    progress(f"{name}: vllm behind Duet's gateway" + (" + one Duet prefix worker" if kinds else ""))
    with peer_vllm.VllmServer(venv, model, served_name, stack_dir, **vllm_limits,
                              extra_args=peer_vllm.backend_args(kv_port, replay_port)) as server:
        extra = {"backends": [backend_entry(server, kv_port, replay_port)]}
        with ServingStack(model, kinds, {}, duet_limits, log_dir=stack_dir, gateway_extra=extra) as stack:
            return measure(stack.url)
