"""What one engine worker is told at its start: `duet engine paged|prefix|sim` as frozen dataclasses.

`EngineConfig` holds the settings every engine kind shares (model, device, KV budget, batch limits, where it
listens, how it drains); `PagedConfig`, `PrefixConfig` and `SimConfig` each hold an `EngineConfig` plus only the
fields that kind reads, and name in `SHARED` the shared fields it reads (the sim reads no device, KV budget,
batch limits, threads, tensor parallelism, drain or metrics). Each default is written here once: the engines'
builders, the schedulers, the offline LLM and the benchmarks read `ENGINE_DEFAULTS`.

Every field is also its command-line flag (`max_num_seqs` is `--max-num-seqs`, its help in the field's
metadata), so a new setting is one line here and a kind's subcommand takes exactly the flags of its fields:
a flag another kind reads is an argparse error. No torch here: the CLI imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from duet.auto_dtype import DTYPES
from duet.contract import ENGINE_KINDS, PAGED, PREFIX, SIM

PAGED_POLICIES = ("fcfs", "priority")
PREFIX_POLICIES = ("lpm", "dfs-weight", "fcfs")  # engine_prefix.policy.Policy (a test keeps them equal)
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("none", "int8")  # engine_core.cpu_linear.QUANTIZATIONS (a test keeps them equal)


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A config field and its flag: `flag` holds argparse keywords (type, choices, required, metavar) and
    `group`, the name of a mutually exclusive group it belongs to."""
    return field(default=default, metadata={"help": help, **flag})


def _names(text: str) -> tuple[str, ...]:
    return tuple(c for c in text.split(",") if c)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(None, "model directory (Hugging Face format), .gguf file or pullable name "
                                      "(default: the tiny random model; sim: only its config is read)", type=str)
    dtype: str = setting("auto", "dtype the model computes and caches K/V in (a fp32 directory is cast at load; a "
                                 ".gguf or pulled model is converted to it): auto is bfloat16 on a CPU with AMX or "
                                 "AVX512_BF16, float32 on other CPUs, the directory's own on CUDA "
                                 "(duet/auto_dtype.py)", choices=DTYPES)
    device: str = setting("auto", "where the model runs (cuda with no CUDA device is an error)", choices=DEVICES)
    threads: int | None = setting(None, "torch CPU threads of this worker (default: OMP_NUM_THREADS, else every "
                                        "core it may use)", type=int)
    quantization: str = setting("none", "int8: weights as int8 with one scale per output channel, weight-only "
                                        "(CPU, fp32 checkpoints; a quarter of the weight bytes)",
                                choices=QUANTIZATIONS)
    compile: bool | None = setting(None, "torch.compile (inductor) the decoder layers' elementwise work at start-up, "
                                         "cached in the cache dir (CPU, unquantized; default: on where a C++ "
                                         "compiler is found, unless DUET_COMPILE=0)",
                                   action=argparse.BooleanOptionalAction)
    enforce_eager: bool = setting(False, "CUDA: run every step eagerly (default: a decode-only step of up to "
                                         "256 sequences replays a CUDA graph captured on first use, as vLLM does)")
    page_size: int = setting(16, "tokens per KV page", type=int)
    kv_cache_tokens: int | None = setting(None, "KV cache capacity in tokens", type=int, group="kv budget")
    kv_cache_memory_gb: float | None = setting(None, "KV cache capacity in GiB", type=float, group="kv budget")
    max_num_seqs: int = setting(64, "most requests running at once", type=int)
    max_num_batched_tokens: int = setting(2048, "most tokens one step computes", type=int)
    tensor_parallel_size: int = setting(1, "split the model over N ranks, one process and device each "
                                           "(torch.distributed: NCCL on GPUs, gloo on CPU)", type=int)
    host: str = setting("127.0.0.1", "address the gRPC server listens on", type=str)
    port: int = setting(0, "gRPC port", type=int, required=True)
    worker_id: str | None = setting(None, "worker id (default: host:port)", type=str)
    version: str = setting("v1", "deploy label, used by canary pools", type=str)
    drain_timeout: float = setting(30.0, "seconds to finish requests on SIGTERM", type=float)
    metrics_port: int | None = setting(None, "Prometheus metrics port (off if unset)", type=int)
    redis: str | None = setting(None, "register this worker in Redis (heartbeats)", type=str)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be 1 or more")
        if self.quantization != "none" and self.tensor_parallel_size > 1:
            raise ValueError(f"--quantization {self.quantization} does not combine with --tensor-parallel-size")

    @property
    def worker_label(self) -> str:
        """The worker id GetInfo and the registry report."""
        return self.worker_id or f"{self.host}:{self.port}"


ENGINE_DEFAULTS = EngineConfig()


# engine_paged: prompt tokens a step may add beside decodes, by device. Too few and every step pays its fixed cost
# (the weights read once) again for a few prompt tokens: on one CPU core (35-57 ms a step, 1.4-2.2 ms a prompt token,
# loadtests/sim/fleet/cpu_cost.json) 64 ran the paged worker past its capacity in duet bench classes, 256 did not;
# on an H200 (Llama-3.1-8B, the fleet simulation) 512 kept 99% of the uncapped goodput (docs/benchmarks.md)
PREFILL_TOKENS_WHILE_DECODING = {"cpu": 256, "cuda": 512}


@dataclass(frozen=True)
class PagedConfig:
    """`duet engine paged`: vLLM-style paged KV with automatic prefix caching."""

    SHARED: ClassVar[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(EngineConfig))
    engine: EngineConfig = EngineConfig()
    enable_prefix_caching: bool = setting(True, "automatic prefix caching of full KV pages (default: on, as in vLLM)")
    schedule_policy: str = setting("fcfs", "admission order: fcfs, or priority (a request's `priority`, lower "
                                           "first, then arrival)", choices=PAGED_POLICIES)
    max_prefill_tokens_while_decoding: int | None = setting(
        None, "most prompt tokens a step prefills while any sequence decodes; decodes are scheduled first "
              "(default: 256 on a CPU, 512 on a GPU; 0: no cap beyond --max-num-batched-tokens)", type=int)
    max_decode_step_stretch: float = setting(
        0.0, "bound a decoding step's prefill in time instead: the prompt tokens whose measured cost keeps the step "
             "within S x a decode-only step's time, at least 8, at most the cap above (0: off, the cap alone)",
        type=float, metavar="S")

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 0:
            raise ValueError(f"max_prefill_tokens_while_decoding={self.max_prefill_tokens_while_decoding}: "
                             "must be 0 (no cap) or more")
        if self.max_decode_step_stretch and not self.max_decode_step_stretch > 1:
            raise ValueError(f"max_decode_step_stretch={self.max_decode_step_stretch}: must be 0 (off) or above 1")

    def prefill_tokens_while_decoding(self, device_type: str) -> int:
        """The cap on a decoding step's prefill tokens on a `device_type` ("cpu", "cuda") device."""
        if self.max_prefill_tokens_while_decoding is not None:
            return self.max_prefill_tokens_while_decoding
        return PREFILL_TOKENS_WHILE_DECODING.get(device_type, PREFILL_TOKENS_WHILE_DECODING["cpu"])


@dataclass(frozen=True)
class PrefixConfig:
    """`duet engine prefix`: SGLang-style radix cache, cache-aware scheduling, n-gram speculation."""

    SHARED: ClassVar[tuple[str, ...]] = PagedConfig.SHARED
    engine: EngineConfig = EngineConfig()
    schedule_policy: str = setting("lpm", "admission order: lpm (longest cached prefix first), dfs-weight, or fcfs "
                                          "(a request's `priority`, lower first, then arrival)",
                                   choices=PREFIX_POLICIES)
    aging_s: float = setting(2.0, "lpm / dfs-weight: a request that has waited this many seconds is admitted ahead "
                                  "of the cache-aware order, oldest first (0: off)", type=float)
    cache_eviction: str = setting("reuse-aware", "radix cache eviction: reuse-aware (prefixes no request has hit "
                                                 "go first, so one-shot prompts do not evict reused ones) or lru",
                                  choices=("reuse-aware", "lru"))
    # on by default: on the real SmolLM2 it cut copy/edit TPOT p50 2.2x and chat 2.3x, capacity +19% / +29%
    # (docs/benchmarks.md, per-kind defaults); greedy requests only, output unchanged, back-off where nothing repeats
    speculative: str = setting("ngram", "n-gram (prompt lookup) speculative decoding of greedy requests "
                                        "(default: ngram; off: none)", choices=("off", "ngram"))
    num_draft_tokens: int = setting(4, "draft tokens per step with --speculative ngram", type=int)

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.aging_s < 0:
            raise ValueError(f"aging_s={self.aging_s}: must be 0 (off) or more")

    @property
    def draft_tokens(self) -> int | None:
        """Draft tokens per step; None: no speculation."""
        return self.num_draft_tokens if self.speculative == "ngram" else None


@dataclass(frozen=True)
class SimConfig:
    """`duet engine sim`: the model-free worker (duet/sim_worker.py); it reads only these shared fields."""

    SHARED: ClassVar[tuple[str, ...]] = ("model", "dtype", "host", "port", "worker_id", "version", "page_size",
                                         "redis")
    engine: EngineConfig = EngineConfig()
    sim_ms_per_token: float = setting(20.0, "decode time per token (ms)", type=float)
    sim_prefill_ms_per_token: float = setting(0.05, "prefill time per uncached prompt token (ms)", type=float)
    sim_fail_rate: float = setting(0.0, "fraction of requests that fail before their first token", type=float)
    sim_cache_blocks: int = setting(4096, "simulated prefix cache size, in blocks", type=int)
    sim_load_s: float = setting(0.0, "seconds it answers NOT_SERVING after it starts listening, as an engine "
                                     "does while it loads its model", type=float)
    sim_as: str = setting(PREFIX, "engine kind to pose as", choices=ENGINE_KINDS)
    sim_capabilities: tuple[str, ...] | None = setting(None, "comma-separated capabilities (default: the posed "
                                                             "kind's)", type=_names, metavar="CAP,...")

    def __post_init__(self) -> None:
        _check_choices(self)


KindConfig = PagedConfig | PrefixConfig | SimConfig
KINDS: dict[str, type[KindConfig]] = {PAGED: PagedConfig, PREFIX: PrefixConfig, SIM: SimConfig}


def _check_choices(config) -> None:
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(config, f.name) not in choices:
            raise ValueError(f"{f.name}={getattr(config, f.name)!r}: choose one of {', '.join(choices)}")


def _own_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name != "engine"]


def _add_flag(parser, groups: dict, f: dataclasses.Field) -> None:
    meta = dict(f.metadata)
    target = parser
    if (group := meta.pop("group", None)) is not None:
        if group not in groups:
            groups[group] = parser.add_mutually_exclusive_group()
        target = groups[group]
    if isinstance(f.default, bool):
        meta["action"] = argparse.BooleanOptionalAction
    elif "action" in meta:
        pass
    elif "type" not in meta and "choices" not in meta:
        meta["type"] = type(f.default)
    target.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default, **meta)


def add_flags(parser: argparse.ArgumentParser, cls: type[KindConfig]) -> None:
    """The flags of one kind: the shared fields it reads, then its own."""
    groups: dict = {}
    shared = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in cls.SHARED:
        _add_flag(parser, groups, shared[name])
    for f in _own_fields(cls):
        _add_flag(parser, groups, f)


def from_args(cls: type[KindConfig], args: argparse.Namespace) -> KindConfig:
    """The config a kind's parsed flags describe (flags it does not take keep their defaults)."""
    engine = EngineConfig(**{name: getattr(args, name) for name in cls.SHARED})
    return cls(engine=engine, **{f.name: getattr(args, f.name) for f in _own_fields(cls)})

