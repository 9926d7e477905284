"""An idle gateway sleeps: the real `duet gateway` process, with no request and no worker to poll, wakes its event
loop a few times a second, not ~17 (uvicorn's 0.1 s tick and the stream watchdog's 0.25 s one were most of them,
and each wake of a sleeping process costs CPU: docs/benchmarks.md, the gateway's CPU per request); its answers
still carry a `date` header, and SIGTERM still stops it at once."""

from __future__ import annotations

import email.utils
import signal
import subprocess
import time
import urllib.request

import psutil
import yaml

from duet.launcher import duet_argv, free_port, gateway_config
from duet.model_make import default_model_dir


def test_an_idle_gateway_wakes_rarely_keeps_its_date_header_and_stops_at_once(tmp_path):
    port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(gateway_config(default_model_dir(), [], port=port, poll_interval_s=1.0)))
    log = (tmp_path / "gateway.log").open("wb")
    proc = subprocess.Popen(duet_argv("gateway", "--config", str(cfg)), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, headers = time.monotonic() + 60, None
        while headers is None and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    headers = r.headers
            except OSError:
                time.sleep(0.2)
        assert headers is not None, (tmp_path / "gateway.log").read_text()
        sent = email.utils.parsedate_to_datetime(headers["date"]).timestamp()
        assert abs(sent - time.time()) < 5  # the date header is kept current

        time.sleep(2.0)  # startup's own work done
        p = psutil.Process(proc.pid)
        w0 = p.num_ctx_switches().voluntary
        time.sleep(5.0)
        wakes_per_s = (p.num_ctx_switches().voluntary - w0) / 5.0
        # ~2-4 a second now (the fleet's 1 s poll loop and the other 1 s ticks), 14 or more with uvicorn's 0.1 s
        # tick and the watchdog's 0.25 s one; the bound leaves room for a loaded machine's stray wakes
        assert wakes_per_s < 8, wakes_per_s

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)  # (uvicorn raises the signal again once shut down: -15)
        assert proc.returncode in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 5  # the 1 s tick does not hold up a shutdown (the signal wakes it)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
