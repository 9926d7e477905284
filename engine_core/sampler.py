"""Batched next-token sampling with per-row settings.

Pipeline for one step (vLLM order), on logits [B, V] fp32:
  raw logprobs (for the logprobs output) -> min_tokens mask (EOS/stop ids -inf) -> logit_bias -> repetition,
  frequency, presence penalties -> greedy rows: argmax | others: temperature -> min_p -> top_k -> top_p -> sample.

Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly one noise vector per
row. A seeded row draws its noise from its own torch.Generator, so its tokens depend only on its seed and its
logits, never on which other rows share the batch. Unseeded rows share the sampler's generator.

Device: `Sampler.device` is the one place the engines take it from. Schedulers make every per-request
generator with `Sampler.make_generator` (a generator on another device than the logits' fails the whole
step on a GPU), and every tensor here is made on `logits.device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine_core.request import TokenLogprob
from engine_core.sampling_params import SamplingParams


def greedy_ids(logits: Tensor) -> Tensor:
    """The index of each row's largest logit, the first one on a tie (as argmax). `max` along the row rather
    than `argmax`: torch's CPU argmax is 1.7x slower on fp32 rows and 4.6x on bf16 ones (16 x 49152 logits,
    one thread, Intel Xeon with AMX: 1.02 / 2.56 ms against 0.60 / 0.56), and a bf16 model's greedy step
    takes it once per step."""
    return logits.max(dim=-1).indices


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for a seeded request (None when unseeded). No default device on purpose:
    engines call `Sampler.make_generator`, which passes the sampler's."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence this step. `generator` is the request's own
    (Sampler.make_generator(params.seed)), kept by the caller across steps so a seeded stream continues."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the row did not ask for logprobs


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device | str = "cpu",
                 seed: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        """A seeded request's own generator, on the device the logits will be on (None when unseeded)."""
        return make_generator(seed, self.device)

    @torch.inference_mode()
    def sample(self, logits: Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        assert logits.shape[0] == len(rows), "one sampler row per logits row"
        # the common batch (greedy or plain temperature, no logprobs, penalties or min_tokens) costs a few
        # whole-batch tensor ops; the per-row work below runs only for the rows that ask for it
        want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
        token_ids = self._choose(self.penalized_logits(logits, rows), rows)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        for i in want_logprobs:
            k, token = rows[i].params.logprobs, token_ids[i]
            top = ()
            if k > 0:
                values, ids = raw_logprobs[i].topk(min(k, self.vocab_size))
                top = tuple(zip(ids.tolist(), values.tolist()))
            logprobs[i] = TokenLogprob(token, raw_logprobs[i, token].item(), top)
        return SamplerOutput(token_ids, logprobs)

    def penalized_logits(self, logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
        """`logits` in fp32 after the min_tokens mask, the logit bias and the penalties: what greedy rows take the
        argmax of and what temperature/top-k/top-p/min-p then shape for the others. The caller's tensor is never
        changed (a copy is made when there is something to change)."""
        banned = self._banned_tokens(rows)
        biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
        penalized = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
                     or r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
        if not banned and not biased and not penalized:
            return logits.float()
        logits = logits.float().clone()  # callers may reuse their tensor
        if banned:
            row_ids, token_ids = zip(*banned)
            logits[list(row_ids), list(token_ids)] = float("-inf")
        if biased:
            row_ids, token_ids, values = zip(*biased)
            logits[list(row_ids), list(token_ids)] += torch.tensor(values, device=logits.device)
        if penalized:
            self._apply_penalties(logits, rows, penalized)
        return logits

    def _banned_tokens(self, rows: Sequence[SampleRow]) -> list[tuple[int, int]]:
        """min_tokens: (row, token) pairs that cannot be sampled yet, EOS (unless ignore_eos) and stop ids."""
        pairs = []
        for i, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                pairs.extend((i, t) for t in banned)
        return pairs

    def _apply_penalties(self, logits: Tensor, rows: Sequence[SampleRow], index: list[int]) -> None:
        sub = logits[index]
        counts = _token_counts([rows[i].output_token_ids for i in index], self.vocab_size, logits.device)
        rep = torch.tensor([rows[i].params.repetition_penalty for i in index], device=logits.device)[:, None]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in index], device=logits.device)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in index], device=logits.device)[:, None]
        # repetition (CTRL / HF): tokens seen in the prompt or the output; divide positive logits, multiply negative
        seen = (_token_counts([rows[i].prompt_token_ids for i in index], self.vocab_size, logits.device) > 0) | (
            counts > 0)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        # frequency and presence (OpenAI): generated tokens only
        sub = sub - freq * counts - pres * (counts > 0).float()
        logits[index] = sub

    def _choose(self, logits: Tensor, rows: Sequence[SampleRow]) -> list[int]:
        index = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not index:
            return greedy_ids(logits).tolist()
        everyone = len(index) == len(rows)
        probs = _filtered_probs(logits if everyone else logits[index], [rows[i].params for i in index])
        seeded = [k for k, i in enumerate(index) if rows[i].generator is not None]
        if not seeded:  # one draw for the whole batch from the sampler's generator
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
        else:
            noise = torch.empty_like(probs)
            shared = [k for k, i in enumerate(index) if rows[i].generator is None]
            if shared:
                noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                    generator=self.generator)
            for k in seeded:
                generator = rows[index[k]].generator
                assert generator.device.type == probs.device.type, (
                    f"a generator on {generator.device} for logits on {probs.device}: make it with "
                    "Sampler.make_generator")
                noise[k].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        if everyone:
            return sampled.tolist()
        chosen = greedy_ids(logits)
        chosen[index] = sampled
        return chosen.tolist()


@torch.inference_mode()
def prompt_logprobs(logits: Tensor, next_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row i of `logits` [R, V] is the model's prediction after some prompt position; `next_ids[i]` is the
    prompt token that follows it. Its logprob and the top k alternatives, from the raw logits (the scores
    vLLM's prompt_logprobs and OpenAI's echo return)."""
    assert logits.shape[0] == len(next_ids), "one prompt token per logits row"
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(list(next_ids), dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    tops = [()] * len(chosen)
    if k > 0:
        values, top_ids = logp.topk(min(k, logp.shape[1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(next_ids, chosen, tops)]


def _token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device) -> Tensor:
    """[len(sequences), vocab] float counts of each token id in each sequence."""
    counts = torch.zeros(len(sequences), vocab_size, device=device)
    for i, ids in enumerate(sequences):
        if len(ids):
            ids_t = torch.as_tensor(list(ids), dtype=torch.int64, device=device)
            counts[i].scatter_add_(0, ids_t, torch.ones(len(ids), device=device))
    return counts


def _filtered_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Probabilities after temperature, min_p, top_k and top_p; rows renormalized over the kept tokens."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temperature
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    vocab = logits.shape[1]
    if any(p.top_k is not None and p.top_k < vocab for p in params):
        k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens above it already reach top_p (so the top token always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)
