"""After the forward pass: cache newly full pages, sample, fork, append, detect the end, say what to stream.

- Plain requests: one sampler row per sequence that asked for logits.
- n > 1: when the prompt's prefill completes, the prompt sequence is forked into n sequences
  (pages shared; `Sequence i` samples with seed + i, like engine_core.llm.LLM) and each samples
  its first token from the same logits row.
- Beam search (beam_width W): the live beams' log-softmax rows are scored together; the best W
  continuations survive (a beam chosen twice is forked, a beam not chosen is freed); a candidate
  ending in EOS/stop becomes a finished hypothesis. The search ends when W hypotheses are done
  and none of the live beams can beat them, or at max_tokens. The best n hypotheses are then sent
  whole, ranked, with replaces_previous=True. Score = cumulative logprob / len ** length_penalty.

`OutputProcessor` is owned by the scheduler and sees only what it is given (the block manager, the
sampler, the model's limits), so it never imports the scheduler back.
"""

from __future__ import annotations

import torch

from duet.contract import FinishReason
from engine_core.request import StepOutput
from engine_core.sampler import Sampler, SampleRow, prompt_logprobs
from engine_core.scheduler_protocol import SchedulerOutput
from engine_paged.block_manager import BlockManager
from engine_paged.sequence import GroupStatus, ScheduledSeq, Sequence, SequenceGroup


class OutputProcessor:
    def __init__(self, block_manager: BlockManager, sampler: Sampler, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.bm = block_manager
        self.sampler = sampler
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len

    def process(self, batch: SchedulerOutput[ScheduledSeq], logits: torch.Tensor) -> list[StepOutput]:
        return process(self, batch, logits)


def process(proc: OutputProcessor, batch: SchedulerOutput[ScheduledSeq], logits: torch.Tensor
            ) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    rows: list[tuple[SequenceGroup, Sequence, int]] = []  # plain sampling: (group, seq, logits row)
    beam_groups: dict[int, SequenceGroup] = {}
    row = 0
    for e in batch.entries:
        if e.prompt_rows:
            start = e.seq.num_computed + 1  # the row at position p scores prompt token p + 1
            e.group.prompt_logprobs += prompt_logprobs(logits[row:row + e.prompt_rows],
                                                       e.seq.token_ids[start:start + e.prompt_rows],
                                                       e.group.request.params.prompt_logprobs)
            row += e.prompt_rows
        e.seq.num_computed += e.num_tokens
        proc.bm.cache_full_blocks(e.seq.seq_id, e.seq.token_ids, e.seq.num_computed, e.group.request.cache_salt)
        if not e.wants_logits:
            continue
        if e.group.is_beam:
            # beams advance together: hold each row until every live beam of the group has one
            e.group.beam_logits[e.seq.seq_id] = logits[row]
            beam_groups[id(e.group)] = e.group
        elif not e.group.forked and e.group.width > 1:
            for seq in _fork_outputs(proc, e.group, e.seq):
                rows.append((e.group, seq, row))
        else:
            rows.append((e.group, e.seq, row))
        row += 1
    if rows:
        # the request's own prompt and a view of the output: no per-step copy of either
        sample_rows = [SampleRow(g.request.params, g.request.prompt_token_ids, s.outputs, s.generator)
                       for g, s, _ in rows]
        out = proc.sampler.sample(logits[[r for _, _, r in rows]], sample_rows)
        for (group, seq, _), token, lp in zip(rows, out.token_ids, out.logprobs):
            outputs.append(_append(proc, group, seq, token, lp))
    for group in beam_groups.values():
        if all(s.seq_id in group.beam_logits for s in group.live):
            rows_by_seq, group.beam_logits = group.beam_logits, {}
            outputs += _beam_step(proc, group, [(s, rows_by_seq[s.seq_id]) for s in group.live])
    return outputs


def _fork_outputs(proc: OutputProcessor, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
    seed = group.request.params.seed
    children = []
    for i in range(1, group.width):
        child = parent.copy_as(i, proc.sampler.make_generator(None if seed is None else (seed + i) % 2**64))
        proc.bm.fork(parent.seq_id, child.seq_id)
        children.append(child)
    group.seqs += children
    group.forked = True
    return [parent] + children


def _finish_reason(proc: OutputProcessor, group: SequenceGroup, seq: Sequence) -> FinishReason | None:
    reason = group.request.params.finish_reason(seq.outputs, proc.eos_token_ids,
                                                max_model_len=proc.max_model_len, num_prompt_tokens=seq.num_prompt)
    return None if reason is None else FinishReason(reason)


def _prompt_info(group: SequenceGroup) -> dict:
    if group.prompt_sent:
        return {}
    info = {"prompt_tokens": len(group.request.prompt_token_ids), "cached_tokens": group.cached_tokens or 0}
    if group.request.params.prompt_logprobs is not None:
        info["prompt_logprobs"], group.prompt_logprobs = group.prompt_logprobs, []
    group.prompt_sent = True
    return info


def _append(proc: OutputProcessor, group: SequenceGroup, seq: Sequence, token: int, lp) -> StepOutput:
    seq.token_ids.append(token)
    if lp is not None:
        seq.logprobs.append(lp)
        seq.cumulative_logprob += lp.logprob
    seq.finish_reason = _finish_reason(proc, group, seq)
    new = seq.token_ids[seq.num_prompt + seq.num_sent:]
    new_lps = seq.logprobs[seq.num_sent:] if lp is not None else None
    seq.num_sent = seq.num_output
    if seq.finish_reason is not None:
        proc.bm.free(seq.seq_id)
        if all(s.finished for s in group.seqs):
            group.status = GroupStatus.FINISHED
    return StepOutput(group.request_id, seq.index, new, new_lps, seq.finish_reason, seq.cumulative_logprob,
                      **_prompt_info(group))


# -- beam search -------------------------------------------------------------------------------
def _score(seq: Sequence, length_penalty: float) -> float:
    return seq.cumulative_logprob / max(1, seq.num_output) ** length_penalty


def _beam_step(proc: OutputProcessor, group: SequenceGroup, beam_rows: list[tuple[Sequence, torch.Tensor]]
               ) -> list[StepOutput]:
    params = group.request.params
    width = params.beam_width
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(proc.eos_token_ids))
    parents = [s for s, _ in beam_rows]
    logits = torch.stack([r for _, r in beam_rows]).float()  # [beams, vocab]
    if params.logit_bias:  # beams rank by the biased distribution, as sampling would draw from it
        ids, values = zip(*params.logit_bias)
        logits[:, list(ids)] += torch.tensor(values, device=logits.device)
    logp = torch.log_softmax(logits, dim=-1)
    if parents[0].num_output < params.min_tokens and stops:
        logp[:, sorted(stops)] = float("-inf")
    total = logp + torch.tensor([p.cumulative_logprob for p in parents])[:, None]
    values, flat = total.flatten().topk(min(2 * width, total.numel()))
    vocab = logp.shape[1]
    keep: list[tuple[int, int, float]] = []  # (parent index, token, cumulative logprob)
    for rank, (v, f) in enumerate(zip(values.tolist(), flat.tolist())):
        b, token = divmod(f, vocab)
        if token in stops:
            if rank < width:
                done = parents[b].copy_as(0, None)
                done.token_ids.append(token)
                done.cumulative_logprob, done.finish_reason = v, FinishReason.STOP
                group.beams_done.append(done)
        else:
            keep.append((b, token, v))
        if len(keep) == width:
            break
    # forks first (from the parents' current state), then appends, then frees
    new_live: list[Sequence] = []
    used: set[int] = set()
    for b, token, v in keep:
        parent = parents[b]
        if b in used:
            seq = parent.copy_as(0, None)
            proc.bm.fork(parent.seq_id, seq.seq_id)
        else:
            seq = parent
            used.add(b)
        new_live.append((seq, token, v))
    for b, parent in enumerate(parents):
        if b not in used:
            proc.bm.free(parent.seq_id)
    live = []
    for seq, token, v in new_live:
        seq.token_ids.append(token)
        seq.cumulative_logprob = v
        live.append(seq)
    group.seqs = live
    group.forked = True
    out_len = live[0].num_output if live else 0
    at_limit = live and (out_len >= params.max_tokens or len(live[0].token_ids) >= proc.max_model_len)
    if at_limit:
        for seq in live:
            seq.finish_reason = FinishReason.LENGTH
        group.beams_done += live
    lp = params.length_penalty
    best_live = max((_score(s, lp) for s in live), default=float("-inf"))
    done = sorted(group.beams_done, key=lambda s: _score(s, lp), reverse=True)
    if not (at_limit or not live or (len(done) >= width and _score(done[width - 1], lp) >= best_live)):
        return []
    for seq in live:
        proc.bm.free(seq.seq_id)
    group.seqs = []
    group.status = GroupStatus.FINISHED
    info = _prompt_info(group)
    outputs = []
    for rank, seq in enumerate(done[:params.n]):
        outputs.append(StepOutput(group.request_id, rank, seq.output_token_ids, None, seq.finish_reason,
                                  seq.cumulative_logprob, replaces_previous=True, **(info if rank == 0 else {})))
    return outputs
