"""Batched next-token sampling with per-row settings.

Pipeline for one step (vLLM order), on logits [B, V] fp32:
  raw logprobs (for the logprobs output) -> min_tokens mask (EOS/stop ids -inf) -> repetition, frequency,
  presence penalties -> greedy rows: argmax | others: temperature -> min_p -> top_k -> top_p -> sample.

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
        for row in rows:
            assert row.generator is None or row.generator.device.type == logits.device.type, (
                f"a generator on {row.generator.device} for logits on {logits.device}: "
                "make it with Sampler.make_generator")
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if wants_logprobs else None
        token_ids = self._choose(self.penalized_logits(logits, rows), rows)
        logprobs: list[TokenLogprob | None] = []
        for i, (row, token) in enumerate(zip(rows, token_ids)):
            if row.params.logprobs is None:
                logprobs.append(None)
                continue
            top = ()
            if row.params.logprobs > 0:
                values, ids = raw_logprobs[i].topk(min(row.params.logprobs, self.vocab_size))
                top = tuple(zip(ids.tolist(), values.tolist()))
            logprobs.append(TokenLogprob(token, raw_logprobs[i, token].item(), top))
        return SamplerOutput(token_ids, logprobs)

    def penalized_logits(self, logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
        """A fp32 copy of `logits` after the min_tokens mask and the penalties: what greedy rows take the argmax
        of and what temperature/top-k/top-p/min-p then shape for the others."""
        logits = logits.float().clone()  # callers may reuse their tensor
        self._mask_stop_tokens(logits, rows)
        self._apply_penalties(logits, rows)
        return logits

    def _mask_stop_tokens(self, logits: Tensor, rows: Sequence[SampleRow]) -> None:
        """min_tokens: EOS (unless ignore_eos) and stop ids cannot be sampled before min_tokens outputs."""
        for i, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")

    def _apply_penalties(self, logits: Tensor, rows: Sequence[SampleRow]) -> None:
        index = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
                 or r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
        if not index:
            return
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
        chosen = logits.argmax(dim=-1)
        index = [i for i, r in enumerate(rows) if not r.params.greedy]
        if index:
            probs = _filtered_probs(logits[index], [rows[i].params for i in index])
            noise = torch.empty_like(probs)
            shared = [k for k, i in enumerate(index) if rows[i].generator is None]
            if shared:
                noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                    generator=self.generator)
            for k, i in enumerate(index):
                if rows[i].generator is not None:
                    noise[k].exponential_(generator=rows[i].generator)
            chosen[index] = (probs / noise).argmax(dim=-1)
        return chosen.tolist()


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
