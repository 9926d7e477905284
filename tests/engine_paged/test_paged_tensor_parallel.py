"""engine_paged with its model split over 2 ranks (CPU, gloo) gives the tokens it gives on one: greedy,
seeded n=2 sampling (whose forked sequences copy-on-write their shared last page on every rank) and a prompt
served from the prefix cache."""

from __future__ import annotations

from duet.engine_config import EngineConfig, PagedConfig
from engine_core.engine_core import EngineCore
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_paged.worker import build_engine


def _run(core: EngineCore, requests: list[Request]) -> dict[tuple[str, int], list[int]]:
    for r in requests:
        core.add(r)
    tokens: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished():
        for o in core.step().outputs:
            assert o.error is None, o.error
            key = (o.request_id, o.index)
            tokens[key] = list(o.token_ids) if o.replaces_previous else tokens.get(key, []) + list(o.token_ids)
    return tokens


def _serve(checkpoint, tp: int) -> tuple[dict, int, int]:
    """(tokens of every request, CoW page copies, prefix-cache hit tokens) on a paged engine of `tp` ranks."""
    parts = build_engine(PagedConfig(EngineConfig(model=str(checkpoint), device="cpu", kv_cache_tokens=2048,
                                                  tensor_parallel_size=tp)))
    copies: list[tuple[int, int]] = []
    copy_pages = parts.scheduler.copy_pages

    def counted(pairs):
        copies.extend(pairs)
        copy_pages(pairs)

    parts.scheduler.copy_pages = counted
    core = EngineCore(parts.scheduler, parts.runner)
    shared = [(7 * i) % 900 + 3 for i in range(37)]
    try:
        tokens = _run(core, [
            Request("greedy", shared, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
            # 21 tokens: the last page is partial, so the two samples copy it before they write
            Request("n2", shared[:21], SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2, ignore_eos=True)),
        ])
        # after the first batch: 32 of these 37 tokens are two full pages the cache kept
        tokens |= _run(core, [Request("cached", shared[:32] + [11, 12, 13, 14, 15],
                                      SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
        hits = parts.scheduler.load().prefix_cache_hits_tokens
    finally:
        if tp > 1:
            parts.runner.close()
    return tokens, len(copies), hits


def test_two_ranks_serve_the_tokens_of_one(tiny_checkpoint):
    want, want_copies, want_hits = _serve(tiny_checkpoint, 1)
    got, copies, hits = _serve(tiny_checkpoint, 2)
    assert got == want
    assert len(got[("n2", 0)]) == 6 and got[("n2", 0)] != got[("n2", 1)]
    assert copies == want_copies > 0
    assert hits == want_hits >= 32
