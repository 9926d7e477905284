"""After the forward pass: cache finished prefill chunks, sample, verify drafts, append, detect the end, say what
to stream.

- A prefill chunk's computed whole pages go into the radix tree at once (`BlockManager.cache_prefix`); the
  prompt's last chunk also samples the first output token.
- Sampling masks constrained rows first (structured.apply_masks), then calls the shared sampler on every row.
- A decode token with drafts verifies them in one row block (speculative.accept_greedy): the accepted drafts
  plus the model's own next token are appended; a wholly rejected draft backs the request off drafting.
- A request that ends (EOS, stop, length, a completed grammar) gives its pages back at once, its prompt and
  output cached (`BlockManager.release`), and is marked finished; the scheduler drops it from the running.

`OutputProcessor` is owned by the scheduler and sees only what it is given (the block manager, the sampler,
the model's limits), so it never imports the scheduler back, as in engine_paged.postprocess.
"""

from __future__ import annotations

import torch

from duet.contract import FinishReason
from engine_core.request import StepOutput
from engine_core.sampler import Sampler, SampleRow, prompt_logprobs
from engine_core.scheduler_protocol import SchedulerOutput
from engine_prefix import speculative
from engine_prefix.block_manager import BlockManager
from engine_prefix.sequence import ScheduledSeq, Seq
from engine_prefix.structured import apply_masks


class OutputProcessor:
    def __init__(self, block_manager: BlockManager, sampler: Sampler, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.bm = block_manager
        self.sampler = sampler
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.draft_tokens = 0  # speculative drafts verified ...
        self.accepted_tokens = 0  # ... and how many of them the model agreed with

    def process(self, batch: SchedulerOutput[ScheduledSeq], logits: torch.Tensor) -> list[StepOutput]:
        row = 0
        sampled: list[tuple[Seq, int]] = []
        drafted: list[tuple[ScheduledSeq, int]] = []
        for e in batch.entries:
            seq = e.seq
            if e.prompt_rows:
                first = seq.num_computed + 1  # the row at position p scores prompt token p + 1
                seq.prompt_logprobs += prompt_logprobs(logits[row:row + e.prompt_rows],
                                                       seq.tokens[first:first + e.prompt_rows],
                                                       seq.req.params.prompt_logprobs)
                row += e.prompt_rows
            if e.prefill:
                seq.num_computed += e.num_tokens
                self.bm.cache_prefix(seq)
                if seq.num_computed == len(seq.tokens):
                    sampled.append((seq, row))
                    row += 1
            elif e.draft:
                drafted.append((e, row))
                row += len(e.draft) + 1
            else:
                seq.num_computed += 1
                sampled.append((seq, row))
                row += 1
        outputs: list[StepOutput] = []
        if sampled:
            sub = logits[[r for _, r in sampled]].float()
            apply_masks(sub, [(i, s.constraint) for i, (s, _) in enumerate(sampled) if s.constraint is not None])
            rows = [SampleRow(s.req.params, s.req.prompt_token_ids, s.output, s.generator) for s, _ in sampled]
            result = self.sampler.sample(sub, rows)
            for (seq, _), token, logprob in zip(sampled, result.token_ids, result.logprobs):
                outputs.append(self._append(seq, [token], [logprob] if logprob is not None else None))
        for e, r in drafted:
            accepted = speculative.accept_greedy(e.draft, logits[r : r + len(e.draft) + 1])
            self.draft_tokens += len(e.draft)
            self.accepted_tokens += len(accepted) - 1
            seq = e.seq
            if len(accepted) == 1:  # back off exponentially while drafts miss; greedy output is unaffected
                seq.draft_misses += 1
                seq.draft_cooldown = min(2 ** seq.draft_misses, 32)
            else:
                seq.draft_misses = 0
            seq.num_computed += len(accepted)  # the last token and the accepted drafts now have KV
            outputs.append(self._append(seq, accepted, None))
        return outputs

    def _append(self, seq: Seq, tokens: list[int], logprobs) -> StepOutput:
        p = seq.req.params
        new: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            seq.tokens.append(token)
            new.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            if seq.constraint is not None and seq.constraint.terminated:
                reason = FinishReason.STOP
            else:
                rule = p.finish_reason(seq.output, self.eos_token_ids, max_model_len=self.max_model_len,
                                       num_prompt_tokens=seq.num_prompt)
                reason = None if rule is None else FinishReason(rule)
            if reason is not None:
                break
        out = StepOutput(seq.req.request_id, 0, new, logprobs=logprobs, finish_reason=reason)
        stamp_first(seq, out)
        if reason is not None:
            seq.finish_reason = reason
            self.bm.release(seq, cache=True)
        return out


def stamp_first(seq: Seq, out: StepOutput) -> None:
    """The request's first message carries its prompt and cached token counts (and the prompt's logprobs)."""
    if not seq.reported:
        seq.reported = True
        out.prompt_tokens = seq.num_prompt
        out.cached_tokens = seq.cached_prompt_tokens
        if seq.req.params.prompt_logprobs is not None:
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []
