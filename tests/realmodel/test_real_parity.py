"""SmolLM2-135M-Instruct on our engine core equals transformers (fp32): logits within 1e-4 for a whole
prefill, a chunked prefill, a prefix-cache hit and step-by-step decode; greedy 64 tokens identical to
`generate`, alone and in a ragged batch of 8 (the paged scheduler; engine_prefix's greedy parity runs
through the whole stack in test_real_stack.py). The runner's tests and the batch of 8 run eager and with
`--compile` (engine_core.cpu_compile), within the same tolerances."""

from __future__ import annotations

import pytest
import torch

from duet.model_dir import read_model_dir
from duet.tokenizer import Tokenizer
from engine_core import LLM, SamplingParams
from engine_core.cpu_compile import is_compiled
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import KVPool, PageAllocator
from engine_core.model_runner import ModelRunner

ATOL = 1e-4
PAGE = 16
TEXTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "def fibonacci(n):",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog does not react at all.",
    "Hi!",
]


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    tok = Tokenizer.from_dir(smollm2_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in TEXTS]


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "compiled"])
def runner(smollm2_dir, request):
    md = read_model_dir(smollm2_dir)
    c = md.config
    pool = KVPool(c.num_hidden_layers, 64, PAGE, c.num_key_value_heads, c.head_dim, "float32", "cpu")
    model = ModelRunner(md, pool, "cpu", compile=request.param)
    assert is_compiled(model.model) == request.param
    return model, PageAllocator(64)


@torch.inference_mode()
def _hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0].float()


def test_whole_and_chunked_prefill_match_transformers(runner, hf_smollm2, prompts):
    model, alloc = runner
    ids = prompts[2]
    ref = _hf_logits(hf_smollm2, ids)
    n = len(ids)
    pages = alloc.alloc(-(-n // PAGE))
    torch.testing.assert_close(model.forward([SeqChunk(ids, 0, pages, tuple(range(n)))]), ref, atol=ATOL, rtol=0)
    got = [model.forward([SeqChunk(ids[a:b], a, pages, tuple(range(b - a)))]) for a, b in ((0, 17), (17, 40), (40, n))]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)
    alloc.free(pages)


def test_prefix_cache_hit_matches_transformers(runner, hf_smollm2, prompts):
    """Two chats share the system prompt: the second computes only its own tokens, attending to the
    first one's pages for the shared prefix (what a radix or block-cache hit does)."""
    model, alloc = runner
    first, second = prompts[0], prompts[1]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // PAGE * PAGE
    assert shared >= PAGE, "the chats should share at least one full page"
    pages_a = alloc.alloc(-(-len(first) // PAGE))
    model.forward([SeqChunk(first, 0, pages_a, ())])
    pages_b = pages_a[: shared // PAGE] + alloc.alloc(-(-len(second) // PAGE) - shared // PAGE)
    got = model.forward([SeqChunk(second[shared:], shared, pages_b, tuple(range(len(second) - shared)))])
    torch.testing.assert_close(got, _hf_logits(hf_smollm2, second)[shared:], atol=ATOL, rtol=0)
    alloc.free(pages_a + pages_b[shared // PAGE:])


DECODE_ATOL = 5e-4


def test_step_by_step_decode_matches_transformers(runner, hf_smollm2, prompts):
    """Prefill, then one token per step for 24 steps, two ragged sequences decoded together.

    Decode rows are single-row GEMMs and a paged attention whose sums run in another order than
    transformers' full-sequence forward; through 30 layers of a real model that moves a logit by up to
    ~2e-4 (transformers' own cached decode differs from its full forward by 7e-5 on this model). So every
    logit must be within 5e-4 and the argmax must agree at every step."""
    model, alloc = runner
    seqs = [prompts[3], prompts[6]]
    full = [ids + hf_greedy(hf_smollm2, ids, 24) for ids in seqs]
    refs = [_hf_logits(hf_smollm2, ids) for ids in full]
    pages = [alloc.alloc(-(-len(ids) // PAGE)) for ids in full]
    for ids, p in zip(seqs, pages):
        model.forward([SeqChunk(ids, 0, p, ())])
    for step in range(24):
        chunks = [SeqChunk([f[len(s) + step - 1]], len(s) + step - 1, p, (0,)) for s, f, p in zip(seqs, full, pages)]
        got = model.forward(chunks)
        want = torch.stack([r[len(s) + step - 1] for s, r in zip(seqs, refs)])
        diff = (got - want).abs()
        assert diff.max().item() <= DECODE_ATOL, f"step {step}: max |diff| {diff.max().item():.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for p in pages:
        alloc.free(p)


@torch.inference_mode()
def hf_greedy(hf, ids, n):
    # an explicit mask: the chat prompt holds <|im_end|>, which transformers would take for padding
    t = torch.tensor([ids])
    out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=2)
    return out[0, len(ids):].tolist()


GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy_64(hf_smollm2, prompts):
    return [hf_greedy(hf_smollm2, ids, 64) for ids in prompts]


def test_greedy_64_alone_matches_generate(smollm2_dir, prompts, hf_greedy_64):
    [out] = LLM(smollm2_dir, page_size=PAGE).generate([prompts[0]], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy_64[0]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_64_ragged_batch_of_8_matches_generate(smollm2_dir, prompts, hf_greedy_64, compile):
    outs = LLM(smollm2_dir, page_size=PAGE, max_num_batched_tokens=96, compile=compile).generate(prompts, GREEDY)
    for out, want in zip(outs, hf_greedy_64):
        assert out.outputs[0].token_ids == want
