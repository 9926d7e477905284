"""A real Prometheus (Debian's `prometheus` package) scrapes a running `duet up` — one engine_paged and one
engine_prefix worker on the tiny model, each on the metrics port `duet up` gives it and prints, behind its
gateway — while traffic runs; then every query of deploy/grafana/duet.json and every rule of
deploy/prometheus/duet-rules.yml is evaluated through Prometheus's HTTP API. Every query must evaluate without
error, every dashboard query must return data (a finite value) for what the traffic produced, and every rule
must be loaded and evaluated healthy. Panels the traffic here cannot feed are listed in `NEEDS_OTHER_TRAFFIC`
with the reason."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.support.stack import ROOT, free_port, model_dir
from tests.support.up import Up

DASHBOARD = ROOT / "deploy" / "grafana" / "duet.json"
RULES = ROOT / "deploy" / "prometheus" / "duet-rules.yml"
PROMETHEUS = shutil.which("prometheus")
VOCAB_SIZE = json.loads((model_dir() / "config.json").read_text())["vocab_size"]
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes here (scrapes every second)
# (panel title, target index) -> why this test's traffic cannot make it return data
NEEDS_OTHER_TRAFFIC = {
    ("Automatic canary rollbacks and ramp steps", 0): "needs an automatic canary rollback (the series appear "
    "with the first one; tests/gateway/test_rollback_live.py drives one)",
    ("Automatic canary rollbacks and ramp steps", 1): "needs a canary ramp step (likewise)",
    ("Engine failures: retries and mid-stream errors", 0): "needs a worker failing before the first token "
    "(the series appear with the first retry; tests/e2e and duet bench chaos drive failures)",
    ("Engine failures: retries and mid-stream errors", 1): "needs a worker failing mid-stream (likewise)",
}

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus package (`make setup`)"),
              pytest.mark.timeout(480)]  # `duet up` loads two real engines first


class Stack:
    """`duet up --paged 1 --prefix 1` as a subprocess; the worker metrics URLs it prints."""

    def __init__(self) -> None:
        # the paged worker without prefix caching: the gateway's index (fed by its routing decisions) then
        # expects blocks that worker never kept, which is what the stale-decision panel counts; the prefix
        # worker drafts n-gram tokens, which the speculative panel shows
        self.up = Up("--device", "cpu", "--paged", "1", "--prefix", "1",
                     "--paged-args=--no-enable-prefix-caching --kv-cache-tokens 2048",
                     "--prefix-args=--speculative ngram --num-draft-tokens 3 --kv-cache-tokens 2048")
        try:
            self.up.wait_ready(240)
        except BaseException:
            self.up.stop()
            raise
        self.url = self.up.url
        (line,) = [ln for ln in self.up.out if ln.startswith("Worker metrics:")]
        self.worker_metrics = re.findall(r"(paged-0|prefix-0) http://(127\.0\.0\.1:\d+)/metrics", line)
        assert [w for w, _ in self.worker_metrics] == ["paged-0", "prefix-0"], line

    @property
    def engine_targets(self) -> list[str]:
        return [target for _, target in self.worker_metrics]

    def stop(self) -> None:
        assert self.up.stop(signal.SIGTERM) == 0


class Prometheus:
    def __init__(self, tmp: Path, gateway: str, engines: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "duet-gateway", "static_configs": [{"targets": [gateway]}]},
                                     {"job_name": "duet-engine", "static_configs": [{"targets": engines}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: httpx.get(self.url + "/-/ready", timeout=2).status_code == 200, 60, "ready")

    def wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, "prometheus exited: see its log"
            time.sleep(0.25)
        raise AssertionError(f"prometheus not {what} after {timeout_s:.0f}s")

    def api(self, path: str, **params) -> dict:
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def traffic(url: str, model: str) -> None:
    """What an operator's dashboard shows: streamed chats sharing a system prompt (prefix hits, inter-token
    latency), speculative requests (draft/accepted tokens), n=2 requests sent twice (paged; stale decisions),
    and a rejected body (a 4xx in the request counts)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # in rounds a few scrapes apart: a series is born with its first request, and rate() needs a later
    # sample that differs, so one burst faster than a scrape would leave the latency panels empty
    for r in range(3):
        one_round(client, model, r)
        time.sleep(2.5)
    client.close()


def one_round(client: openai.OpenAI, model: str, r: int) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    for i in range(3):
        stream = client.chat.completions.create(
            model=model, messages=[system, {"role": "user", "content": f"Question number {r}.{i}"}], max_tokens=12,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        assert list(stream)[-1].usage.completion_tokens == 12
    # every token id of the vocabulary as the prompt: whatever token the (random) model emits has been seen
    # before, so the n-gram proposer drafts from the second step on, whatever the weights
    client.completions.create(model=model, prompt=list(range(VOCAB_SIZE)), max_tokens=12,
                              temperature=0, extra_body={"speculative": True, "ignore_eos": True})
    long_prompt = "A document about something unrelated to everything else. " * 8
    for _ in range(2):
        client.completions.create(model=model, prompt=long_prompt, max_tokens=4, n=2, seed=1,
                                  extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=-1)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    stack = Stack()
    prom = None
    try:
        gw = stack.url.removeprefix("http://")
        prom = Prometheus(tmp_path_factory.mktemp("prometheus"), gw, stack.engine_targets)
        prom.wait(lambda: all(t["health"] == "up" for t in prom.api("targets")["activeTargets"])
                  and len(prom.api("targets")["activeTargets"]) == 3, 30, "scraping all three targets")
        traffic(stack.url, model_dir().name)
        time.sleep(2.0)  # the gateway's pool planner and health poll publish their gauges
        # a few scrapes after the traffic, so every rate() has two samples that differ
        prom.wait(lambda: prom.api("query", query="sum(duet_generation_tokens_total)")["result"]
                  and float(prom.api("query", query="sum(increase(duet_generation_tokens_total[1m]))")["result"][0][
                      "value"][1]) > 0, 30, "seeing the traffic")
        time.sleep(3.0)
        yield prom
    finally:
        if prom is not None:
            prom.stop()
        stack.stop()


def _dashboard_targets() -> list[tuple[str, int, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], i, t["expr"]) for p in dash["panels"] for i, t in enumerate(p["targets"])]


def _promql(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$model"', '".*"')


def test_every_dashboard_query_evaluates_and_returns_data(scraped):
    empty = []
    for title, i, expr in _dashboard_targets():
        result = scraped.api("query", query=_promql(expr))["result"]
        values = [float(s["value"][1]) for s in result]
        has_data = any(math.isfinite(v) for v in values)
        if (title, i) in NEEDS_OTHER_TRAFFIC:
            continue
        if not has_data:
            empty.append(f"{title!r} #{i}: {expr} -> {values or 'no series'}")
    assert not empty, "dashboard queries with no data for the traffic sent:\n" + "\n".join(empty)


def test_the_listed_exceptions_are_still_dashboard_queries():
    assert set(NEEDS_OTHER_TRAFFIC) <= {(t, i) for t, i, _ in _dashboard_targets()}


def test_the_model_variable_lists_the_served_model(scraped):
    dash = json.loads(DASHBOARD.read_text())
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "model"]
    assert var["query"] == "label_values(duet_prompt_tokens_total, model)"  # Grafana's label_values(): the API
    values = scraped.api("label/model/values", **{"match[]": "duet_prompt_tokens_total"})
    assert model_dir().name in values


def test_every_rule_is_loaded_and_evaluates_healthy(scraped):
    names = [r.get("alert") or r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]

    def evaluated() -> list[dict]:
        rules = [r for g in scraped.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else []

    scraped.wait(lambda: bool(evaluated()), 30, "evaluating every rule")
    rules = evaluated()
    assert sorted(r["name"] for r in rules) == sorted(names)
    bad = [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] != "ok" or r.get("lastError")]
    assert not bad, bad
    for rule in (r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]):
        scraped.api("query", query=rule["expr"])  # each expression on its own, through the query API


def test_the_slo_ratios_see_the_traffic_per_model_and_kind(scraped):
    """The alerts' inputs are not vacuous: the recorded TTFT/TPOT ratios exist for the kinds that served."""
    for record in ("duet:ttft_slow_ratio:rate5m", "duet:tpot_slow_ratio:rate5m"):
        scraped.wait(lambda r=record: bool(scraped.api("query", query=r)["result"]), 20, f"recording {record}")
        result = scraped.api("query", query=record)["result"]
        assert {s["metric"]["engine"] for s in result} == {"paged", "prefix"}
        assert all(s["metric"]["model"] == model_dir().name and 0 <= float(s["value"][1]) <= 1 for s in result)
