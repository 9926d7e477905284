"""What the API tests share: a gateway in front of one prefix sim and one paged sim (real gRPC, one
per test module), and an openai SDK client for it. Modules that need another stack (auth keys,
Redis, more workers) build their own."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import GatewayThread, Sim, gateway_config, start_sims


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    sims = start_sims([Sim("prefix"), Sim("paged")], tmp_path_factory.mktemp("sims"))
    gw = GatewayThread(gateway_config(sims)).start()
    yield gw
    gw.stop()
    for s in sims:
        s.kill()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
