"""The two `duet bench peer` stacks with vLLM behind Duet's gateway (gateway/backends/http_backend.py):

    duet_over_vllm          Duet's gateway in front of one vLLM server (its only pool): the gateway's overhead
                            on a real engine, read against the `vllm` side (vLLM alone) of the same run;
    vllm_paged_duet_prefix  vLLM as the paged pool plus one Duet prefix worker, Duet's routing between them.

Each starts its own vLLM server (the same flags as the `vllm` side, plus what the gateway needs of it:
`peer_vllm.backend_args`, KV events included), so no stack sees a cache another one warmed. Their figures
join the peer JSON as sides beside the Duet engine kinds.

The gateway's overhead is read on one server: duet_over_vllm's vLLM is first measured directly (side
`vllm_backend`: the same loads on prompts of the same shapes that share nothing with the gateway's, before the
gateway starts), then through the gateway, and duet_over_vllm's ratios are against that. Against the `vllm`
side they would also count the flags the backend server adds and one more server start. The order (direct
first) is fixed; each pass has its own warm-up. vllm_paged_duet_prefix is compared with the `vllm` side.

The gateway runs on the cores vLLM reserves for its own front-end (its log's `reserved_cpus`, core 1 of 2 by
default), beside vLLM's API server, as a deployment would place it: unpinned, the scheduler may put it on the
core vLLM's model worker is bound to and take compute from it. A Duet worker is not pinned.
"""

from __future__ import annotations

from pathlib import Path

STACKS = ("duet_over_vllm", "vllm_paged_duet_prefix")
DIRECT = "vllm_backend"  # duet_over_vllm's server, measured without the gateway


def wrapped_side(stack: str) -> str:
    """The side a stack's ratios are against (module doc)."""
    return DIRECT if stack == "duet_over_vllm" else "vllm"


def backend_entry(server, kv_port: int, replay_port: int) -> dict:
    """The gateway config's `backends` entry for a peer_vllm.VllmServer started with backend_args()."""
    return {"engine": "vllm", "url": server.url, "kind": "paged",
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv_port}",
                          "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}}


def measure_stack(name: str, venv: Path, model: Path, served_name: str, log_dir: Path, vllm_limits: dict,
                  duet_limits, measure, progress) -> dict[str, dict[str, dict]]:
    """{side: {load: figures}}: the stack's, and for duet_over_vllm its server's alone (DIRECT) as well;
    `measure(url, tag)` runs the loads against a URL, on the prompts `tag` keys."""
    from duet.launcher import free_port
    from loadtests.experiments import peer_vllm
    from loadtests.experiments.stack import NO_DRAFTING, ServingStack

    if name not in STACKS:
        raise ValueError(f"unknown stack {name!r}; choose from {', '.join(STACKS)}")
    kinds = [] if name == "duet_over_vllm" else ["prefix"]
    stack_dir = log_dir / name
    stack_dir.mkdir(parents=True, exist_ok=True)
    kv_port, replay_port = free_port(), free_port()
    progress(f"{name}: vllm behind Duet's gateway" + (" + one Duet prefix worker" if kinds else ""))
    with peer_vllm.VllmServer(venv, model, served_name, stack_dir, **vllm_limits,
                              extra_args=peer_vllm.backend_args(kv_port, replay_port)) as server:
        sides = {}
        if name == "duet_over_vllm":
            progress(f"{name}: its vllm server alone first ({DIRECT})")
            sides[DIRECT] = measure(server.url, "direct-")
        extra = {"backends": [backend_entry(server, kv_port, replay_port)]}
        front = ",".join(map(str, server.reserved_cpus())) or None  # module doc: the gateway is a front-end
        progress(f"{name}: the gateway on cpus {front}" if front else f"{name}: vllm reserves no cpu; gateway unpinned")
        with ServingStack(model, kinds, {}, duet_limits, log_dir=stack_dir, gateway_extra=extra,
                          gateway_cpus=front, worker_args=NO_DRAFTING) as stack:  # as vLLM
            sides[name] = measure(stack.url, "")
        return sides
