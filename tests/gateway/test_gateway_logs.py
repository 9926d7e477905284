"""What `duet gateway` logs at its default level: what changes in its pool (a worker serving, one lost), never
the polls behind it (health, load and info polls of gRPC workers and HTTP backends, several a second here);
`--log-level debug` shows the polls too. Real processes: two sim workers, one of them behind a second gateway
that the gateway under test reaches as an OpenAI-compatible HTTP backend."""

from __future__ import annotations

import re
import time
from pathlib import Path

import yaml

from duet.launcher import (
    Launcher,
    SimOptions,
    WorkerSpec,
    duet_argv,
    free_port,
    gateway_config,
    healthy_workers,
)
from duet.model_make import default_model_dir

POLL = re.compile(r"(GET|POST) \S+/(health|metrics|v1/models|tokenize)[? ]")  # /metrics?name[]=...


def test_polls_stay_out_of_the_default_log_and_changes_are_in_it(tmp_path):
    model, logs = default_model_dir(), tmp_path / "logs"
    grpc_port, inner_worker, inner, outer, outer_debug = (free_port() for _ in range(5))
    url, debug_url, backend = (f"http://127.0.0.1:{p}" for p in (outer, outer_debug, inner))
    with Launcher(logs) as stack:
        stack.start_worker("sim-a", WorkerSpec("sim", model, grpc_port, "sim-a", sim=SimOptions("prefix")))
        stack.start_worker("sim-b", WorkerSpec("sim", model, inner_worker, "sim-b", sim=SimOptions("paged")))
        stack.start_gateway("inner", gateway_config(model, [f"127.0.0.1:{inner_worker}"], port=inner))
        stack.wait_until(lambda: healthy_workers(backend) >= 1, timeout_s=60)
        def config(port: int) -> dict:
            # idle_poll_s as the poll interval: the backend stays idle here, and a quiet backend is otherwise
            # polled every 5 s (gateway/backends/http_backend.py), too few polls for the debug log's count
            return gateway_config(model, [f"127.0.0.1:{grpc_port}"], port=port,
                                  health={"poll_interval_s": 0.2, "idle_poll_s": 0.2},
                                  backends=[{"engine": "openai", "url": backend}])

        stack.start_gateway("outer", config(outer))  # the default level
        (tmp_path / "debug.yaml").write_text(yaml.safe_dump(config(outer_debug)))
        stack.supervisor.start("outer-debug", duet_argv("gateway", "--config", str(tmp_path / "debug.yaml"),
                                                        "--log-level", "debug"))
        stack.wait_until(lambda: healthy_workers(url) >= 2 and healthy_workers(debug_url) >= 2, timeout_s=60)
        time.sleep(2.0)  # ten polls of each worker
        stack.supervisor.stop("sim-a")
        deadline = time.monotonic() + 20
        while "stopped answering" not in _read(logs / "outer.log") and time.monotonic() < deadline:
            time.sleep(0.2)
    default, debug = _read(logs / "outer.log"), _read(logs / "outer-debug.log")
    assert not [line for line in default.splitlines() if POLL.search(line)], default
    # a handful of lines for a whole run (~6 on a quiet machine); logging each poll would write 30 or more,
    # and the bound leaves room for a worker that a loaded machine makes miss a poll and come back
    assert len(default.splitlines()) <= 14, default
    sim_a = f"worker sim-a at 127.0.0.1:{grpc_port}"
    assert f"INFO {sim_a}: serving tiny-llama-v2 (prefix, v1)" in default
    assert f"INFO worker {backend}: serving tiny-llama-v2 (paged, external)" in default
    assert f"WARNING {sim_a} stopped answering the gateway's polls" in default
    polls = [line for line in debug.splitlines() if POLL.search(line)]
    assert len(polls) >= 10 and all(" DEBUG " in line for line in polls), debug


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
