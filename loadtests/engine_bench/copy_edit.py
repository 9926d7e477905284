"""Speculative decoding on real text: a copy/edit load for `engine_bench prefix --model DIR`.

Prompt-lookup (n-gram) drafting pays off when the answer repeats the prompt: rewriting a paragraph
with small changes, or quoting a source before summarizing it. Each prompt here is such a chat,
rendered with the model's own template; every request runs alone (batch 1), greedy, once with
drafting off and once with k=4 drafts, on a fresh engine each, the prompt cached by a warm-up so
both sides time the same decode. The outputs must be token-identical (the speedup is free or it
is a bug), and the figures are output tokens/s over the whole load plus the share of drafted
tokens the model accepted.
"""

from __future__ import annotations

from engine_core.request import Request
from loadtests.engine_bench.common import greedy, prefix_engine

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
    "keeper climbed the narrow spiral stairs, trimmed the wick, and watched the beam sweep across the dark "
    "water. Ships passing the rocky coast trusted the light to guide them safely into the harbor. When the "
    "keeper grew old, the town installed an electric lamp, and the stairs were climbed only by curious "
    "visitors who wanted to see the view of the sea from the top of the tower."
)
TASKS = [
    f"Rewrite the following paragraph exactly, but replace the word 'keeper' with 'guardian':\n\n{PARAGRAPH}",
    f"Copy this paragraph word for word, changing 'lighthouse' to 'tower of light':\n\n{PARAGRAPH}",
    f"Quote the first three sentences of this text exactly, then summarize it in one line:\n\n{PARAGRAPH}",
    f"Repeat the following text, fixing nothing and changing nothing:\n\n{PARAGRAPH}",
]


def copy_edit_prompts(model_dir) -> list[list[int]]:
    from duet.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in TASKS]


def speculative_on_text(model_dir, quick: bool, run_timed) -> dict:
    """`run_timed(scheduler, runner, requests)` comes from the prefix bench."""
    prompts = copy_edit_prompts(model_dir)[: 2 if quick else None]
    max_tokens = 64 if quick else 128
    tokens_out, seconds, outputs, result = {}, {}, {}, {}
    for k in (None, 4):
        parts = prefix_engine(model_dir, k)
        total_tokens, total_s, outs = 0, 0.0, []
        for i, prompt in enumerate(prompts):
            run_timed(parts.scheduler, parts.runner, [Request(f"warm{i}", prompt, greedy(2))])
            _, tokens, secs = run_timed(parts.scheduler, parts.runner, [Request(f"r{i}", prompt, greedy(max_tokens))])
            total_tokens += len(tokens[f"r{i}"])
            total_s += secs
            outs.append(tokens[f"r{i}"])
        tokens_out[k], seconds[k], outputs[k] = total_tokens, total_s, outs
        if k:
            load = parts.scheduler.load()
            result["spec_draft_tokens"] = load.spec_draft_tokens
            result["spec_accepted_tokens"] = load.spec_accepted_tokens
            result["spec_acceptance_rate"] = round(load.spec_accepted_tokens / max(1, load.spec_draft_tokens), 3)
    off, on = tokens_out[None] / seconds[None], tokens_out[4] / seconds[4]
    result.update(spec_load="copy_edit", spec_requests=len(prompts), spec_output_tokens=tokens_out[4],
                  spec_tok_s_off=round(off, 2), spec_tok_s_on=round(on, 2), spec_speedup=round(on / off, 3),
                  spec_outputs_identical=outputs[None] == outputs[4])
    return result
