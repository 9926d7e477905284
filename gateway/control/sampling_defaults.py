"""What each side of a migration does with a sampling field a request leaves unset, and where they differ.

Switching engines changes sampling defaults: a request that says nothing about top_k is sampled one way by
Duet's engines and another by a vLLM or SGLang server that applies the model's generation_config.json (both
do by default). Through Duet's gateway the difference is narrower than between the servers' own APIs,
because the gateway always sends temperature, top_p, min_p and repetition_penalty (gateway/serving/
generation.py `to_pb`, with duet/contract.py's defaults); what it leaves unset (top_k, seed) is the
engine's to choose. The shadow run reports the differences (`GET /admin/models/{model}/shadow`,
`duet migrate shadow`), so an operator recalibrates before the canary rather than after.

    engine_defaults(engine, generation_config)  one engine's effective value of each field
    differences(primary, candidate)             fields whose values differ between the two sides
"""

from __future__ import annotations

from duet import contract as c

SENT_BY_GATEWAY = ("temperature", "top_p", "min_p", "repetition_penalty")  # always on the wire
LEFT_TO_ENGINE = ("top_k", "seed")  # unset unless the request sets them
EXTERNAL = ("vllm", "sglang", "openai")  # backend engines (gateway/backends/backend_spec.py)


def engine_defaults(engine: str, generation_config: dict) -> dict:
    """The value each field takes for a request that leaves it unset, served through Duet's gateway by
    `engine` (Duet's `paged`/`prefix`/`sim` workers, or an external `vllm`/`sglang`/`openai` backend)."""
    out = {"temperature": c.TEMPERATURE.default, "top_p": c.TOP_P.default, "min_p": c.MIN_P.default,
           "repetition_penalty": c.REPETITION_PENALTY.default, "top_k": None, "seed": "random per request",
           "speculative_greedy": engine == "prefix"}  # engine_prefix drafts greedy requests (--speculative ngram)
    if engine in ("vllm", "sglang"):  # both apply the model's generation_config.json to what is unset
        if generation_config.get("top_k"):
            out["top_k"] = generation_config["top_k"]
    elif engine == "openai":
        out["top_k"] = "the server's own"
    return out


def differences(primary: dict[str, dict], candidate: dict[str, dict]) -> list[dict]:
    """Per field, the values on each side when they differ. `primary` and `candidate` map each engine on
    that side to its `engine_defaults`."""
    out = []
    fields = sorted({f for d in (*primary.values(), *candidate.values()) for f in d})
    for name in fields:
        p = sorted({repr(d.get(name)) for d in primary.values()})
        q = sorted({repr(d.get(name)) for d in candidate.values()})
        if p != q:
            out.append({"field": name, "primary": {e: d.get(name) for e, d in primary.items()},
                        "candidate": {e: d.get(name) for e, d in candidate.items()}})
    return out
