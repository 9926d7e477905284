"""`duet up --tensor-parallel-size 2` on the tiny model: both workers split their model over two ranks, answer
the openai SDK, give the greedy tokens a one-rank engine gives, and leave no rank running after Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from duet_stack import ROOT, free_port, model_dir

from duet.rpc import engine_pb2 as pb
from duet.rpc import engine_pb2_grpc as pb_grpc
from engine_core.engine_core import EngineCore
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams

PROMPT = [5, 17, 300, 42, 999, 8, 8, 123, 64, 2]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _one_rank_tokens(kind: str) -> list[int]:
    if kind == "paged":
        from engine_paged.worker import build_engine
    else:
        from engine_prefix.worker import build_engine
    parts = build_engine(str(model_dir()), kv_cache_tokens=1024)
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


@pytest.mark.timeout(420)
def test_duet_up_with_two_ranks_per_worker_serves_one_rank_tokens_and_leaves_nothing():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "duet.cli", "up", "--port", str(port), "--model", str(model_dir()),
                             "--device", "cpu", "--paged", "1", "--prefix", "1", "--tensor-parallel-size", "2",
                             "--admin-key", "adm"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out: list[str] = []
    everything: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while not (out and out[-1].startswith("Ctrl-C to stop")):
            line = proc.stdout.readline()
            assert (line or proc.poll() is None) and time.monotonic() < deadline, "".join(out)
            out.append(line)
        everything = _descendants(proc.pid)
        ranks = [p for p in everything if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 2, ranks  # one rank process beside each worker (its rank 0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model=model_dir().name, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0)
        assert r.usage.completion_tokens >= 1
        workers = httpx.get(url + "/admin/workers", headers={"Authorization": "Bearer adm"}).json()["workers"]
        assert sorted(w["engine_kind"] for w in workers) == ["paged", "prefix"]
        for w in workers:
            assert _served_tokens(w["address"]) == _one_rank_tokens(w["engine_kind"]), w["engine_kind"]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    assert code == 0
    deadline = time.monotonic() + 15
    while any(map(_alive, everything)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in everything if _alive(p)], "processes left running after Ctrl-C"
