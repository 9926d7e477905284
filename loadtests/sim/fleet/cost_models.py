"""What one engine step costs, in seconds of virtual time: the fleet simulator's only stand-in for the model.

A step is described by its `StepShape`, read from the chunks the REAL scheduler put in the batch
(`shape_of(chunks)`): prefill tokens (multi-token chunks), decode tokens (one-token chunks), context tokens
read (each chunk's end position: the KV it attends to) and attended pairs (query x key pairs of the causal
attention: a chunk of n new tokens after s cached ones has n*s + n*(n+1)/2).

Two models:

- `cpu` (`LinearCostModel`): seconds = intercept + a*prefill + b*decode + c*attended_pairs + d*rows
  + e*decode_context, fitted by
  least squares to step timings of the real `ModelRunner` on this machine (`duet bench fleet-calibrate`,
  loadtests/sim/calibrate/steps.py). The fit, its model, CPU, dtype, thread count and residuals are in the file
  cpu_fit.fit_path() names: `--cost-file`, else this machine's own fit in the user cache, else the repository's
  loadtests/sim/fleet/cpu_cost.json (loadtests/sim/fleet/cpu_fit.py, which also says whether it describes this
  machine).
- `h200` (`RooflineCostModel`): Llama-3.1-8B in bf16 on one H200. FLOPs per step = 2 x 6.98e9 linear
  parameters per new token + 2 x 0.525e9 (lm_head) per logits row + 4 x 32 layers x 4096 (q heads x head
  dim) per attended pair; bytes per step = 16.06e9 of weights (read once per step) + 131,072 B of K/V per
  context token read (32 layers x 8 KV heads x 128 x 2 x bf16) + the same per new token written. Seconds =
  max(FLOPs / (989e12 x 0.55), bytes / (4.8e12 x 0.80)) + 1.0 ms. The efficiency factors: 0.55 of the
  989 TFLOPs dense bf16 peak is what well-tuned prefill GEMMs + flash attention reach at 8B scale; 0.80 of
  the 4.8 TB/s HBM3e bandwidth is a good decode kernel's share; 1.0 ms is the per-step host work (scheduling,
  sampling, launch) that CUDA graphs leave. A decode batch of 32 at 4k context costs 9.7 ms; a first 8,192-
  token prefill chunk 0.24 s (about 34k tokens/s). Checked against Duet's own steps at this shape on an H200
  (loadtests/sim/calibrate/h200.py; docs/benchmarks.md): prefill chunks of 512+ tokens 0.91-1.13x it, decode
  batches of up to 64 sequences 0.94-1.08x (CUDA graphs), 256 sequences up to 1.44x.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.sim.fleet.cpu_fit import REPO_FIT, fit_path

CPU_FIT = REPO_FIT  # the repository's default fit (the simulator reads fit_path()'s)
COST_MODELS = ("cpu", "h200", "h200-70b")


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens: int = 0  # KV tokens the step reads (every chunk's end position)
    attended_pairs: int = 0  # query x key pairs of causal attention
    rows: int = 0  # logits rows (sequences that sample a token)
    decode_context_tokens: int = 0  # KV tokens the decode chunks read (their end positions)


def shape_of(chunks: Sequence) -> StepShape:
    return shape_of_counts((len(c.token_ids), c.start_pos, len(c.logits_positions)) for c in chunks)


def shape_of_counts(chunks) -> StepShape:
    """The shape of a step given as (new tokens, tokens already in the pages, logits rows) per chunk: a
    worker's step trace (engine_core/step_trace.py) records its steps so."""
    prefill = decode = context = pairs = rows = decode_context = 0
    for n, s, r in chunks:
        if n > 1:
            prefill += n
        else:
            decode += 1
            decode_context += s + 1
        context += s + n
        pairs += n * s + n * (n + 1) // 2
        rows += r
    return StepShape(prefill, decode, context, pairs, rows, decode_context)


@dataclass(frozen=True)
class LinearCostModel:
    """seconds = intercept + per_prefill_token*P + per_decode_token*D + per_attended_pair*A + per_row*R
    + per_decode_context_token*C (the paged decode kernel's cost per KV token read)."""

    name: str
    intercept_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_attended_pair_s: float
    per_row_s: float = 0.0
    per_decode_context_token_s: float = 0.0

    def step_seconds(self, s: StepShape) -> float:
        return (self.intercept_s + self.per_prefill_token_s * s.prefill_tokens
                + self.per_decode_token_s * s.decode_tokens + self.per_attended_pair_s * s.attended_pairs
                + self.per_row_s * s.rows + self.per_decode_context_token_s * s.decode_context_tokens)

    @classmethod
    def from_json(cls, path: Path | None = None) -> LinearCostModel:
        """The fit in `path` (default: cpu_fit.fit_path(), the one this machine reads)."""
        path = Path(path) if path is not None else fit_path()
        if not path.is_file():
            raise FileNotFoundError(f"no CPU cost fit at {path}: run `duet bench fleet-calibrate`")
        fit = json.loads(path.read_text()).get("coefficients")
        if fit is None:
            raise ValueError(f"{path} holds no step fit (`coefficients`): run `duet bench fleet-calibrate --out {path}`")
        return cls("cpu", fit["intercept_s"], fit["per_prefill_token_s"], fit["per_decode_token_s"],
                   fit["per_attended_pair_s"], fit.get("per_row_s", 0.0), fit.get("per_decode_context_token_s", 0.0))


STEP_KINDS = ("prefill", "decode", "mixed")


def step_kind(s: StepShape) -> str:
    """prefill (new prompt tokens only), decode (one token per sequence only) or mixed."""
    if s.prefill_tokens and s.decode_tokens:
        return "mixed"
    return "prefill" if s.prefill_tokens else "decode"


@dataclass(frozen=True)
class InSituCostModel:
    """The fit's seconds times the factor its step kind measured in the running stack (cpu_cost.json's `in_situ`,
    loadtests/sim/calibrate/in_situ.py): a worker's forward shares its core with its gRPC server and streaming."""

    base: LinearCostModel
    prefill: float
    decode: float
    mixed: float
    name: str = "cpu"
    # engine kind -> its own factors by step kind, where the section measured them (`by_engine`): the paged and the
    # prefix worker's steps of one kind need not slow alike (their step loops and cache work differ)
    by_engine: dict = field(default_factory=dict)

    def step_seconds(self, s: StepShape) -> float:
        return self.base.step_seconds(s) * getattr(self, step_kind(s))

    def for_engine(self, kind: str) -> InSituCostModel:
        """This model with `kind`'s own factors where they were measured, the all-workers ones elsewhere."""
        own = self.by_engine.get(kind, {})
        return dataclasses.replace(self, by_engine={}, **{k: own[k] for k in STEP_KINDS if k in own})

    @classmethod
    def from_json(cls, path: Path | None = None) -> InSituCostModel | None:
        """None where the file (default: cpu_fit.fit_path()) has no `in_situ` section."""
        path = Path(path) if path is not None else fit_path()
        section = json.loads(path.read_text()).get("in_situ") if path.is_file() else None
        if not section:
            return None
        return cls(LinearCostModel.from_json(path), section["prefill"], section["decode"], section["mixed"],
                   by_engine=section.get("by_engine", {}))


def for_engine(cost_model, kind: str):
    """The cost model a worker of `kind` steps by: an in-situ model's per-engine factors, a per-kind model's
    (loadtests/advise/calibrated.py: each kind calibrated from its own backends' rates) that kind's, any other
    model as is."""
    return cost_model.for_engine(kind) if hasattr(cost_model, "for_engine") else cost_model


@dataclass(frozen=True)
class RooflineCostModel:
    """A roofline of one model on one accelerator (module docstring: the h200 numbers)."""

    name: str = "h200"
    linear_params: float = 6.98e9
    lm_head_params: float = 0.525e9
    layers: int = 32
    q_width: int = 32 * 128  # q heads x head dim
    weight_bytes: float = 16.06e9
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2
    peak_flops: float = 989e12
    peak_bytes_per_s: float = 4.8e12
    compute_efficiency: float = 0.55
    bandwidth_efficiency: float = 0.80
    step_overhead_s: float = 1.0e-3

    def flops(self, s: StepShape) -> float:
        new = s.prefill_tokens + s.decode_tokens
        return (2 * self.linear_params * new + 2 * self.lm_head_params * s.rows
                + 4 * self.layers * self.q_width * s.attended_pairs)

    def bytes_moved(self, s: StepShape) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (s.context_tokens + s.prefill_tokens + s.decode_tokens)

    def step_seconds(self, s: StepShape) -> float:
        return max(self.flops(s) / (self.peak_flops * self.compute_efficiency),
                   self.bytes_moved(s) / (self.peak_bytes_per_s * self.bandwidth_efficiency)) + self.step_overhead_s


# Llama-3.1-70B with FP8 weights on one H200: where KV is scarce (180k tokens a worker, EngineProfile), so one-shot
# prompts evicting reused prefixes (the seed's "cache pollution") can happen at all. Linear parameters 68.5e9
# (80 layers x (q and o 8192 x 8192 each, k and v 8192 x 1024 each, gate/up/down 3 x 8192 x 28672)), LM head
# 1.05e9 (128,256 x 8192); weights read once a step at one byte each (69.6 GB); KV in bf16, 327,680 B a token
# (80 layers x 8 KV heads x 128 x 2 x 2 B); 1,979 TFLOP/s dense FP8 peak; the 8B model's efficiency factors and
# step overhead, not measured for this model (the 8B roofline was checked on an H200: docs/benchmarks.md).
LLAMA_70B_FP8_H200 = RooflineCostModel(
    name="h200-70b", linear_params=68.5e9, lm_head_params=1.05e9, layers=80, q_width=64 * 128,
    weight_bytes=69.6e9, kv_bytes_per_token=2 * 80 * 8 * 128 * 2, peak_flops=1979e12)


def cost_model(name: str):
    if name == "h200":
        return RooflineCostModel()
    if name == "h200-70b":
        return LLAMA_70B_FP8_H200
    if name == "cpu":
        return LinearCostModel.from_json()
    raise ValueError(f"unknown cost model {name!r}; expected one of {', '.join(COST_MODELS)}")
