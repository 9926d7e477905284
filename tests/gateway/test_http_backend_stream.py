"""gateway/backends/http_backend.py streaming end to end: a Duet gateway serves as the `openai` backend of another
gateway (real HTTP and SSE both ways, a real sim worker at the bottom), so the backend client's SSE reading
(duet/sse.py) and chunk decoding run against a real OpenAI-compatible server."""

from __future__ import annotations

import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from duet_stack import GatewayThread, Sim, gateway_config, model_dir, start_sims

MODEL = model_dir().name


def test_a_stream_through_an_openai_backend_is_the_backends_own_answer(tmp_path):
    sims = start_sims([Sim("paged")], tmp_path)
    inner = GatewayThread(gateway_config(sims)).start()
    outer = None
    try:
        outer = GatewayThread(gateway_config([], backends=[{"engine": "openai", "url": inner.url}])).start(
            wait_workers=1)
        args = {"model": MODEL, "prompt": "the backend answers", "max_tokens": 12, "temperature": 0.0,
                "extra_body": {"ignore_eos": True}}
        direct = openai.OpenAI(base_url=inner.url + "/v1", api_key="k", max_retries=0).completions.create(**args)
        c = openai.OpenAI(base_url=outer.url + "/v1", api_key="k", max_retries=0)
        with c.completions.with_streaming_response.create(stream=True, **args) as raw:
            assert raw.headers["x-duet-worker"] == inner.url
            chunks = list(raw.parse())
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert len(chunks) > 2 and text == direct.choices[0].text != ""
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        if outer is not None:
            outer.stop()
        inner.stop()
        for s in sims:
            s.kill()
