"""`duet bench classes --cache-replay`: the eviction rule alone, deterministic (no model, no clock).

The mixed workload of `duet bench classes` (its sessions, agent loops and one-shot documents; structured and
copy/edit too) is replayed one request at a time through engine_prefix's real RadixCache over a page
allocator of `kv_cache_tokens`: each request matches its prompt (the hit), takes pages for the rest (the
cache evicts as it must), and its prompt plus a stand-in answer is inserted, as the scheduler does when a
request finishes. A later turn waits for its parent and resends parent prompt + answer + its own tokens; the
replay goes in rounds (each serves every request whose parent is served, in the mix's order), so between two
turns of a session come all the requests that were ready with it - a hard case for a cache, on purpose.
It runs once per rule (`lru`, `reuse-aware`) and reports, per class, the hit rate (cached / prompt tokens)
and the reused pages evicted. Only cache contents matter here, so the figures are exact and repeatable:
the default in duet/engine_config.py (`--cache-eviction reuse-aware`) was chosen on them (docs/benchmarks.md).
"""

from __future__ import annotations

from engine_core.kv_pool import PageAllocator
from engine_prefix.radix_cache import RadixCache
from loadtests.load.class_workloads import DEFAULT_SIZES, Sizes, class_mix
from loadtests.load.workloads import BenchRequest, TokenSource

RULES = {"lru": False, "reuse-aware": True}


def _replay(requests: list[BenchRequest], src: TokenSource, kv_tokens: int, page: int, protect: bool) -> dict:
    alloc = PageAllocator(kv_tokens // page)
    cache = RadixCache(alloc, page, protect_reused=protect)
    full: dict[str, list[int]] = {}  # request id -> prompt + answer, for its next turn
    per_class: dict[str, list[int]] = {}  # class -> [prompt tokens, hit tokens]
    pending = list(requests)
    while pending:
        ready = [r for r in pending if r.depends_on is None or r.depends_on in full]
        for r in ready:
            prompt = list(r.prompt_token_ids) if r.depends_on is None else full[r.depends_on] + list(r.prompt_token_ids)
            m = cache.match_prefix(prompt[:-1])
            if m.length:
                cache.mark_reused(m.node)
            cache.lock(m.node)
            tokens = prompt + src.draw(f"answer-{r.request_id}", r.max_tokens)
            need = -(-len(tokens) // page) - len(m.pages)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            if alloc.num_free < need:  # larger than the whole cache: served, nothing cached
                cache.unlock(m.node)
            else:
                pages = m.pages + alloc.alloc(need)
                res = cache.insert(tokens, pages)
                whole = len(tokens) // page
                alloc.free(res.duplicate_pages + pages[whole:])
                cache.unlock(m.node)
            counts = per_class.setdefault(r.traffic_class, [0, 0])
            counts[0] += len(prompt)
            counts[1] += m.length
            full[r.request_id] = tokens
        pending = [r for r in pending if r.request_id not in full]
    cache.check_integrity()
    return {"hit_rate": {c: round(h / p, 4) for c, (p, h) in sorted(per_class.items())},
            "reused_pages_evicted": cache.reused_pages_evicted}


def run(src: TokenSource, num_requests: int = 400, kv_budgets: tuple[int, ...] = (8192, 16384, 32768),
        page: int = 16, seed: int = 0, sizes: Sizes = DEFAULT_SIZES) -> dict:
    requests = class_mix(src, num_requests, seed, sizes)
    return {"num_requests": num_requests, "page_size": page, "seed": seed,
            "by_kv_tokens": {str(kv): {rule: _replay(requests, src, kv, page, protect) for rule, protect in RULES.items()}
                             for kv in kv_budgets}}


def format_table(result: dict) -> str:
    first = next(iter(next(iter(result["by_kv_tokens"].values())).values()))
    title = (f"cache replay: {result['num_requests']} requests of the classes mix, page {result['page_size']}; "
             "hit rate per class (cached / prompt tokens) and reused pages evicted")
    head = ["KV tokens", "rule", *first["hit_rate"], "reused pages evicted"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kv, rules in result["by_kv_tokens"].items():
        for rule, r in rules.items():
            lines.append(f"| {kv} | {rule} | " + " | ".join(f"{v:.3f}" for v in r["hit_rate"].values()) +
                         f" | {r['reused_pages_evicted']} |")
    return "\n".join(lines)
