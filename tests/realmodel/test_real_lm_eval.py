"""lm-evaluation-harness (`lm_eval`, its `local-completions` backend) scores a small loglikelihood task from a
local file against Duet on SmolLM2, through /v1/completions with echo + logprobs as lm_eval asks; each
sample's loglikelihood equals the same text scored by transformers (fp32) within 1e-3 (a sum of a few
tokens, each within the tier's 1e-4), on both engine kinds."""

from __future__ import annotations

import json

import pytest
import torch

MODEL = "smollm2-135m-instruct"
# the continuations carry their leading space: this lm_eval joins context and target as they are
DOCS = [{"context": "The capital of France is", "continuation": " Paris."},
        {"context": "Water boils at one hundred degrees", "continuation": " Celsius at sea level."},
        {"context": "def add(a, b):\n    return", "continuation": " a + b"}]
TASK = """task: duet_local_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _reference(hf, tok, context: str, continuation: str) -> float:
    """transformers' loglikelihood of `continuation` after `context`, split into tokens as lm_eval splits
    them (trailing spaces of the context move to the continuation; the whole text is encoded once)."""
    stripped = context.rstrip()
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(stripped, add_special_tokens=False))
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
    return sum(logp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))


@pytest.mark.parametrize("kind", ["paged", "prefix"])
def test_lm_eval_local_completions_loglikelihood_equals_transformers(real_stack, kind, smollm2_dir, hf_smollm2,
                                                                     hf_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    out = simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": real_stack.url(kind) + "/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(smollm2_dir), "num_concurrent": 1,
                    "max_retries": 1},
        tasks=["duet_local_ll"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
        batch_size=1)
    samples = out["samples"]["duet_local_ll"]
    assert sorted(s["doc"]["context"] for s in samples) == sorted(d["context"] for d in DOCS)
    for sample in samples:
        context, continuation = sample["arguments"][0][:2]  # the strings lm_eval scored
        assert context + continuation == sample["doc"]["context"] + sample["doc"]["continuation"]
        loglikelihood, _greedy = sample["resps"][0][0]
        want = _reference(hf_smollm2, hf_tokenizer, context, continuation)
        assert loglikelihood == pytest.approx(want, abs=1e-3), (kind, context, continuation, loglikelihood, want)
