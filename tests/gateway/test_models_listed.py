"""`GET /v1/models` lists a model only while a worker can answer it (healthy, not draining), so a client that
picks a model from the list can use it: a gateway whose worker has not started lists nothing, and lists the model
once the worker serves (a `duet gateway` process; the sim worker starts on its port later)."""

from __future__ import annotations

import httpx

from duet.launcher import Launcher, WorkerSpec, free_port, gateway_config, healthy_workers, listening
from duet.model_make import default_model_dir


def test_a_model_is_listed_once_a_worker_serves_it(tmp_path):
    model, worker, gateway = default_model_dir(), free_port(), free_port()
    url = f"http://127.0.0.1:{gateway}"
    with Launcher(tmp_path / "logs") as stack:
        stack.start_gateway("gateway", gateway_config(model, [f"127.0.0.1:{worker}"], port=gateway,
                                                      poll_interval_s=0.2))
        stack.wait_until(lambda: listening(gateway), timeout_s=60)
        assert httpx.get(url + "/v1/models").json() == {"object": "list", "data": []}
        assert httpx.get(url + "/ready").status_code == 503
        stack.start_worker("sim", WorkerSpec("sim", model, worker, "sim-0"))
        stack.wait_until(lambda: healthy_workers(url) >= 1, timeout_s=60)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [model.name]
        r = httpx.post(url + "/v1/completions", timeout=30, json={"model": model.name, "prompt": "hi",
                                                                  "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
