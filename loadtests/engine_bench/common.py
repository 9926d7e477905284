"""Shared pieces of the engine benchmarks (`python -m loadtests.engine_bench <mode>`): the
checkpoint, random workloads, an in-process driver for any engine_core Scheduler, and the
transformers baselines. The driver is engine_core's one step (EngineCore), as in the serving loop. Each mode (paged.py, prefix.py, ...) composes these into one JSON object."""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_core.engine_core import EngineCore
from engine_core.request import Request, StepOutput
from engine_core.sampling_params import SamplingParams


def bench_checkpoint(preset: str = "bench") -> Path:
    """The deterministic `bench` checkpoint, made once under the temp dir (byte-identical per preset)."""
    from duet.model_make import make_checkpoint

    out = Path(os.environ.get("DUET_BENCH_DIR", Path(tempfile.gettempdir()) / f"duet-bench-{preset}"))
    if not (out / "config.json").is_file():
        make_checkpoint(out, preset=preset)
    return out


def bench_device() -> str:
    """Where the engines run: `--device` (DUET_BENCH_DEVICE), cpu by default."""
    return os.environ.get("DUET_BENCH_DEVICE", "cpu")


def prefix_engine(model_dir, num_draft_tokens: int | None):
    """engine_prefix on the bench device with an 8,192-token KV budget; speculation when `num_draft_tokens`."""
    from duet.engine_config import EngineConfig, PrefixConfig
    from engine_prefix.worker import build_engine

    engine = EngineConfig(model=str(model_dir), device=bench_device(), kv_cache_tokens=8192)
    if num_draft_tokens is None:
        return build_engine(PrefixConfig(engine))
    return build_engine(PrefixConfig(engine, speculative="ngram", num_draft_tokens=num_draft_tokens))


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def random_workload(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                    seed: int = 0) -> Workload:
    """`num` requests with uniform random prompt and output lengths (ids avoid the special low ids)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num)])


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def drive(scheduler, runner, requests: list[Request],
          on_step: Callable[[float, list[StepOutput]], None] | None = None
          ) -> tuple[dict[tuple[str, int], list[int]], float, int]:
    """Run requests to completion through EngineCore.step (no gRPC: the engine loop alone). Returns
    (tokens per (request, index), seconds, steps); `on_step(seconds since start, outputs)` runs after each step."""
    core = EngineCore(scheduler, runner)
    for r in requests:
        core.add(r)
    tokens: dict[tuple[str, int], list[int]] = {}
    steps = 0
    start = time.perf_counter()
    while core.has_unfinished():
        outs = core.step().outputs
        for o in outs:
            if o.error is not None:
                raise o.error
            key = (o.request_id, o.index)
            tokens[key] = list(o.token_ids) if o.replaces_previous else tokens.get(key, []) + list(o.token_ids)
        steps += 1
        if on_step is not None:
            on_step(time.perf_counter() - start, outs)
    return tokens, time.perf_counter() - start, steps


def hf_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_sequential(model, work: Workload) -> float:
    """Seconds for transformers' generate, one request at a time (greedy, exact lengths)."""
    start = time.perf_counter()
    for prompt, m in zip(work.prompts, work.max_tokens):
        ids = torch.tensor([prompt])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_static_batch(model, work: Workload) -> float:
    """Seconds for one left-padded batch through generate: it runs until the longest output is done."""
    width = max(len(p) for p in work.prompts)
    ids = torch.zeros(len(work.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    m = max(work.max_tokens)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start
