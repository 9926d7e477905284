"""Step times of Duet's own engine for the `h200` cost model's model, measured on a CUDA device:
`python -m loadtests.sim.calibrate.h200 [--json] [--out FILE]`.

The `h200` cost model (loadtests/sim/fleet/cost_models.RooflineCostModel) is a roofline of Llama-3.1-8B in bf16 on
one H200 with stated efficiency factors. This script runs that model's shape (random bf16 weights: step time
does not depend on their values) through the real decoder (engine_core/model.py, the Triton kernels of
engine_core/kernels on CUDA) and the real batch builder, one step at a time, as ModelRunner runs it (decode-only
steps replayed from CUDA graphs, engine_core/cuda_graphs.py; the rest eager), and records per step shape the
measured wall time and the eager one (each the median of `repeats` after two warm-ups, synchronized), the roofline's
prediction, and the FLOPs and bytes the roofline counts. It also measures the device's copy bandwidth and dense
bf16 matmul rate, the ceilings the efficiency factors are fractions of. Shapes: prefill chunks of 128..8192
tokens after 0 or 4096 cached, decode batches of 1..256 at 512..4096 tokens of context (at most 512k KV tokens,
64 GiB), and mixed steps. The figures are in docs/benchmarks.md; what they change in the cost model is said there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from duet.model_dir import ModelConfig
from engine_core.cuda_graphs import DecodeGraphs
from engine_core.forward_batch import build_forward_batch
from engine_core.kernels.bench import device_peaks
from engine_core.kv_pool import KVPool
from engine_core.model import DecoderModel
from loadtests.sim.calibrate.steps import _chunks
from loadtests.sim.fleet.cost_models import RooflineCostModel, shape_of

PAGE_SIZE = 16
MAX_POSITIONS = 16384  # the rope cache's length: the longest step here reads 12k positions

LLAMA_31_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
    dtype="bfloat16", bos_token_id=128000, eos_token_ids=(128001,))


def step_shapes() -> list[list[tuple[int, int]]]:
    """Each step as (new tokens, cached tokens before them) per chunk."""
    out: list[list[tuple[int, int]]] = []
    for n in (128, 512, 2048, 8192):
        for start in (0, 4096):
            out.append([(n, start)])
    for batch in (1, 8, 32, 64, 128, 256):
        for context in (512, 2048, 4096):
            if batch * context <= 512 * 1024:
                out.append([(1, context)] * batch)
    for n, batch in ((512, 32), (2048, 64), (8192, 32)):
        out.append([(n, 0)] + [(1, 2048)] * batch)
    return out


def random_model(config: ModelConfig, device: torch.device) -> DecoderModel:
    with torch.device("meta"):
        model = DecoderModel(config, max_positions=MAX_POSITIONS)
    model = model.to_empty(device=device).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.build_rope_cache(device)
    return model


def measure(repeats: int = 5, progress=None) -> dict:
    device = torch.device("cuda")
    roofline = RooflineCostModel()
    config = LLAMA_31_8B
    ceilings = device_peaks(device)
    steps = step_shapes()
    pages = max(sum(-(-(s + n) // PAGE_SIZE) for n, s in step) for step in steps)
    pool = KVPool(config.num_hidden_layers, pages, PAGE_SIZE, config.num_key_value_heads, config.head_dim,
                  torch.bfloat16, device, scratch_page=True)
    model = random_model(config, device)
    graphs = DecodeGraphs(model, pool, MAX_POSITIONS)

    @torch.inference_mode()
    def eager(chunks):  # engine_core/model_runner.ModelRunner.forward, without the checkpoint it loads
        batch = build_forward_batch(chunks, PAGE_SIZE, device)
        hidden = model(batch.input_ids, batch.positions, batch, pool.k_caches, pool.v_caches)
        return model.compute_logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def replayed(chunks):  # what ModelRunner runs for a decode-only step on CUDA
        return graphs.forward(chunks, graphs.shape_for(chunks))

    def timed(forward, chunks) -> float:
        for _ in range(2):
            forward(chunks)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(chunks)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    points = []
    for step in steps:
        chunks = _chunks(step, PAGE_SIZE, config.vocab_size)
        s = shape_of(chunks)
        t_eager = timed(eager, chunks)
        graph = graphs.shape_for(chunks) is not None
        t = timed(replayed, chunks) if graph else t_eager
        point = {"chunks": [list(c) for c in _runs(step)], "prefill_tokens": s.prefill_tokens,
                 "decode_tokens": s.decode_tokens, "context_tokens": s.context_tokens,
                 "attended_pairs": s.attended_pairs, "rows": s.rows, "decode_context_tokens": s.decode_context_tokens,
                 "flops": roofline.flops(s), "bytes": roofline.bytes_moved(s), "seconds": round(t, 6),
                 "eager_seconds": round(t_eager, 6), "cuda_graph": graph,
                 "roofline_seconds": round(roofline.step_seconds(s), 6)}
        point["measured_over_roofline"] = round(t / point["roofline_seconds"], 3)
        points.append(point)
        if progress:
            progress(f"{s}: {t * 1e3:.2f} ms, eager {t_eager * 1e3:.2f} ms (roofline "
                     f"{point['roofline_seconds'] * 1e3:.2f} ms)")
    import triton

    return {
        "how": "python -m loadtests.sim.calibrate.h200 (loadtests/sim/calibrate/h200.py): Duet's decoder, "
               f"Llama-3.1-8B shape, random bf16 weights, decode-only steps from CUDA graphs (eager_seconds: "
               f"without), median of {repeats} synchronized runs per shape after two warm-ups",
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ceilings": ceilings,
        "roofline": {"peak_flops": roofline.peak_flops, "compute_efficiency": roofline.compute_efficiency,
                     "peak_bytes_per_s": roofline.peak_bytes_per_s,
                     "bandwidth_efficiency": roofline.bandwidth_efficiency,
                     "step_overhead_s": roofline.step_overhead_s},
        "points": points,
    }


def _runs(step: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The step as (count, new tokens, cached tokens) runs: a decode batch of 64 is one entry, not 64."""
    out: list[tuple[int, int, int]] = []
    for n, start in step:
        if out and out[-1][1:] == (n, start):
            out[-1] = (out[-1][0] + 1, n, start)
        else:
            out.append((1, n, start))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.sim.calibrate.h200", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("calibrate_h200: no CUDA device is visible to torch; nothing was measured", file=sys.stderr)
        return 2
    result = measure(args.repeats, progress=lambda line: print(line, file=sys.stderr, flush=True))
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        for p in result["points"]:
            print(f"{p['chunks']}: {p['seconds'] * 1e3:.2f} ms, roofline {p['roofline_seconds'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
