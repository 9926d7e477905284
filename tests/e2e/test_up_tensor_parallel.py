"""`duet up --tensor-parallel-size 2` on the tiny model: both workers split their model over two ranks, answer
the openai SDK, give the greedy tokens a one-rank engine gives, and leave no rank running after Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from engine_core.engine_core import EngineCore
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from tests.support import proc_tree
from tests.support.stack import ROOT, free_port, model_dir

PROMPT = [5, 17, 300, 42, 999, 8, 8, 123, 64, 2]


def _one_rank_tokens(kind: str) -> list[int]:
    from duet.engine_config import KINDS, EngineConfig

    if kind == "paged":
        from engine_paged.worker import build_engine
    else:
        from engine_prefix.worker import build_engine
    parts = build_engine(KINDS[kind](EngineConfig(model=str(model_dir()), device="cpu", kv_cache_tokens=1024)))
    core = EngineCore(parts.scheduler, parts.runner)
    core.add(Request("ref", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    while core.has_unfinished():
        for o in core.step().outputs:
            tokens += o.token_ids
    return tokens


def _served_tokens(address: str) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stream = pb_grpc.EngineStub(ch).Generate(pb.GenerateRequest(
            request_id="tp", prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)), timeout=60)
        return [t for msg in stream for t in msg.token_ids]


class Stack:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "up", "--port", str(self.port), "--model",
                                      str(model_dir()), "--device", "cpu", "--paged", "1", "--prefix", "1",
                                      "--tensor-parallel-size", "2", "--admin-key", "adm"],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.out: list[str] = []

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.out and self.out[-1].startswith("Ctrl-C to stop")):
            line = self.proc.stdout.readline()
            assert (line or self.proc.poll() is None) and time.monotonic() < deadline, "".join(self.out)
            self.out.append(line)

    def ranks(self) -> list[int]:
        return [p for p in proc_tree.descendants(self.proc.pid) if proc_tree.alive(p)
                and b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/admin/workers", headers={"Authorization": "Bearer adm"}).json()["workers"]

    def chat(self) -> int:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model=model_dir().name, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0)
        return r.usage.completion_tokens


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    try:
        s.wait_ready(300)
        yield s
    finally:
        everything = proc_tree.descendants(s.proc.pid)
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(timeout=90)
        deadline = time.monotonic() + 15
        while any(map(proc_tree.alive, everything)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert code == 0
        assert not [p for p in everything if proc_tree.alive(p)], "processes left running after Ctrl-C"
        # Ctrl-C reaches every process of a worker's group: the ranks leave it to their worker, which drains
        # (a rank that died of the signal would have ended the drain and the worker with exit 1)
        log_dir = Path(next(line for line in s.out if "logs in " in line).rsplit("logs in ", 1)[1].strip())
        for kind in ("paged", "prefix"):
            log = (log_dir / f"{kind}-0.log").read_text()
            assert "drained (clean)" in log.rsplit("listening on", 1)[-1], log[-2000:]
            assert "exited with code -15" not in log, log[-2000:]


@pytest.mark.timeout(420)
def test_each_worker_runs_two_ranks_and_serves_the_tokens_of_one(stack):
    assert len(stack.ranks()) == 2  # one rank process beside each worker (its rank 0)
    assert stack.chat() >= 1
    workers = stack.workers()
    assert sorted(w["engine_kind"] for w in workers) == ["paged", "prefix"]
    for w in workers:
        assert _served_tokens(w["address"]) == _one_rank_tokens(w["engine_kind"]), w["engine_kind"]


@pytest.mark.timeout(420)
def test_a_killed_rank_restarts_its_whole_worker_while_the_other_serves(stack):
    before = set(stack.ranks())
    victim = next(p for p in before if _parent(p) == _paged_worker_pid(stack.proc.pid))
    os.kill(victim, signal.SIGKILL)
    assert stack.chat() >= 1  # served meanwhile (by the prefix worker, or the paged one once it is back)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ranks = set(stack.ranks())
        ready = httpx.get(stack.url + "/ready").json().get("healthy_workers", {}).get(model_dir().name)
        if len(ranks) == 2 and victim not in ranks and ready == 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the paged worker did not come back with a fresh rank:\n{''.join(stack.out)}")
    paged = next(w for w in stack.workers() if w["engine_kind"] == "paged")
    assert _served_tokens(paged["address"]) == _one_rank_tokens("paged")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _paged_worker_pid(up_pid: int) -> int:
    for pid in proc_tree.descendants(up_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if _parent(pid) == up_pid and b"engine" in argv and b"paged" in argv:
            return pid
    raise AssertionError("no paged worker under duet up")
