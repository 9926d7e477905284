"""`python -m loadtests.engine_bench <mode> [--quick] [--json]`: engine benchmarks on the `bench`
checkpoint. Each mode is a module of this package with `run(quick: bool) -> dict`; add a mode by
adding its name to MODES."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

MODES = {"paged": "loadtests.engine_bench.paged", "prefix": "loadtests.engine_bench.prefix",
         "tp": "loadtests.engine_bench.tp"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.engine_bench")
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--quick", action="store_true", help="smaller workloads (about two minutes on 2 cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: key = value lines)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for the engine and the baselines alike (default 1: on a small "
                             "shared machine OpenMP barriers cost more than a second core gains)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where the engines run (default cpu; the transformers baselines stay on the CPU)")
    parser.add_argument("--model", default=None,
                        help="prefix mode: a model directory, .gguf or pullable name instead of the random "
                             "`bench` checkpoint (e.g. smollm2-135m-instruct)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="tp mode: ranks the model is split over (default 1)")
    parser.add_argument("--preset", default=None, choices=["bench", "smollm2"],
                        help="tp mode: the random checkpoint's shape (default bench; smollm2 for TP 3)")
    args = parser.parse_args(argv)
    if args.mode != "tp" and (args.tensor_parallel_size is not None or args.preset is not None):
        parser.error("--tensor-parallel-size and --preset are for the tp mode")
    if args.device:
        os.environ["DUET_BENCH_DEVICE"] = args.device
    import torch

    torch.set_num_threads(args.threads)
    module = importlib.import_module(MODES[args.mode])
    if args.model:
        from duet.model_pull import resolve_model

        if args.mode != "prefix":
            parser.error("--model is for the prefix mode")
        result = module.run(args.quick, model=str(resolve_model(args.model)))
    elif args.mode == "tp":
        result = module.run(args.quick, tensor_parallel_size=args.tensor_parallel_size or 1,
                            preset=args.preset or "bench")
    else:
        result = module.run(args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key} = {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
