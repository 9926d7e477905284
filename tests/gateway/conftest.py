"""What the API tests share: `make_stack` (a gateway in front of sim workers over real gRPC, torn
down with the test module), the default `stack` (one prefix sim, one paged sim) and an openai SDK
client for it. A module that needs auth keys, Redis or more workers asks `make_stack` for them.

`fake_gateway` is the same gateway in this process in front of fake engines (tests/support/fake_gateway.py):
for tests whose subject is the gateway's own logic (API shapes, errors, dispatch and retries), no process."""

from __future__ import annotations

import openai
import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.fake_gateway import FakeGateway
from tests.support.stack import GatewayThread, Sim, gateway_config, start_sims


@pytest.fixture(scope="module")
def make_stack(tmp_path_factory):
    """make_stack(kinds=("prefix", "paged"), replicas=1, **gateway config) -> the gateway (or a list of
    `replicas` gateways sharing the sims)."""
    sims, gateways = [], []

    def make(kinds=("prefix", "paged"), replicas: int = 1, **config):
        sims.extend(start_sims([Sim(k) for k in kinds], tmp_path_factory.mktemp("sims")))
        made = [GatewayThread(gateway_config(sims, **config)).start() for _ in range(replicas)]
        gateways.extend(made)
        return made[0] if replicas == 1 else made

    yield make
    for g in gateways:
        g.stop()
    for s in sims:
        s.kill()


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def fake_gateway():
    """fake_gateway(*engines, **gateway config) -> a started FakeGateway (default engines: one prefix, one paged),
    stopped after the test."""
    started: list[FakeGateway] = []

    async def make(*engines: FakeEngine, **config) -> FakeGateway:
        gw = FakeGateway(engines or (FakeEngine("prefix"), FakeEngine("paged")), **config)
        started.append(gw)
        return await gw.start()

    yield make
    for gw in reversed(started):
        await gw.stop()
