"""`duet up --backend paged=URL --prefix 1`: the tier's vLLM as the paged pool of a whole `duet up` stack (a sim
prefix worker keeps it cheap), requests split between the two as the routing says, clean shutdown."""

from __future__ import annotations

import openai
import pytest

from tests.support.up import Up

MODEL = "smollm2-135m-instruct"
pytestmark = pytest.mark.timeout(1800)


def test_duet_up_with_a_vllm_paged_pool(backend, model_dir):
    up = Up("--model", str(model_dir), "--sim", "--backend", f"paged={backend.url}", "--prefix", "1")
    try:
        up.wait_ready(180)
        text = "".join(up.out)
        assert f"vllm {backend.url} as a paged pool" in text and "0 paged + 1 prefix" in text
        c = openai.OpenAI(base_url=up.url + "/v1", api_key="k", max_retries=0, timeout=120)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
            temperature=0)
        assert raw.headers["x-duet-worker"] == backend.url and "Paris" in raw.parse().choices[0].message.content
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Say yes"}], max_tokens=4,
            response_format={"type": "json_object"})
        assert raw.headers["x-duet-engine"] == "prefix"
    finally:
        assert up.stop() == 0
