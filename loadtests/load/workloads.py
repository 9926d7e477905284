"""Benchmark workloads: lists of `BenchRequest`, prompts as exact token ids of the target's tokenizer.

Public API (used by `duet bench run` and `duet bench compare`):

    BenchRequest                      one request to send (frozen)
    TokenSource(tokenizer) / TokenSource.from_model_dir(dir)
                                      deterministic token ids from the vocabulary minus special tokens
    chat / multi_turn / agent / long_doc / mix(src, num_requests, max_prompt_tokens, max_tokens, seed, ...)
                                      synthetic traffic classes (see each docstring)
    build_workload(name, src, ...)    one of WORKLOADS by name, the traces included (loadtests/load/trace_workloads.py)
    WorkloadError(ValueError)         bad workload arguments, with a one-line message

Dependencies: a request with `depends_on` is the next turn of a conversation. Its own
`prompt_token_ids` hold only the NEW tokens of that turn (the user's next message, or a tool
result); the client sends `parent's sent prompt + parent's answer (re-encoded, cut to the parent's
max_tokens) + these tokens`, once the parent has finished. So every turn resends the whole history,
as chat clients do, and its length stays bounded by what the generator planned.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from loadtests.traces.mooncake import MOONCAKE_BLOCK_TOKENS, block_token_ids

SYNTHETIC = ("chat", "multi_turn", "agent", "long_doc")
WORKLOADS = (*SYNTHETIC, "mix", "mooncake", "azure-conv", "azure-code")
DEFAULT_SHARES = {"multi_turn": 0.4, "agent": 0.3, "long_doc": 0.2, "chat": 0.1}


SESSION_TURNS = 4  # turns of a multi_turn session and steps of an agent loop, by default


class WorkloadError(ValueError):
    """Workload arguments that cannot make a workload (the message names the argument)."""


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    traffic_class: str  # "chat" | "multi_turn" | "agent" | "long_doc" | "mooncake" | "azure_conv" | "azure_code"
    prompt_token_ids: tuple[int, ...]  # the whole prompt, or only the new turn when depends_on is set
    max_tokens: int
    arrival_s: float | None = None  # open loop: seconds from the start (a dependent turn: not before this)
    ignore_eos: bool = True  # exact output lengths
    session_id: str | None = None  # sent as the x-session-id header
    user: str | None = None  # the body's `user` field
    depends_on: str | None = None  # request_id of the previous turn
    think_s: float = 0.0  # open loop: a dependent turn is sent this long after its parent finished
    response_format: dict | None = None  # the body's response_format (structured output), as OpenAI's


class TokenSource:
    """Token ids drawn deterministically from a vocabulary without its special tokens.

    `draw(key, n)` always gives the same ids for the same key and n (and a prefix of draw(key, m)
    for n < m), so generators build shared prefixes by reusing keys. `block(hash_id)` is a Mooncake
    block (loadtests/traces/mooncake.py's generator, mapped onto the allowed ids)."""

    def __init__(self, vocab_size: int, special_ids: frozenset[int] = frozenset()) -> None:
        allowed = np.array([i for i in range(vocab_size) if i not in special_ids], dtype=np.int64)
        if len(allowed) < 2:
            raise WorkloadError(f"the vocabulary has {len(allowed)} usable token ids; a workload needs 2 or more")
        self.allowed = allowed
        # one int object per allowed id, shared by every prompt: a replayed trace's prompts then cost a
        # pointer per token, not a fresh int each
        self._ints = tuple(int(i) for i in allowed)
        self._block = lru_cache(maxsize=8192)(self._make_block)  # shared prefixes recur (block 0 in every record)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> TokenSource:
        from duet.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(path)
        specials = set(tok.special_token_ids) | set(tok.eos_token_ids)
        return cls(tok.vocab_size, frozenset(specials))

    def draw(self, key: str, n: int) -> list[int]:
        seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        rng = np.random.Generator(np.random.PCG64(seed))
        ints = self._ints
        return [ints[i] for i in rng.integers(0, len(ints), size=n).tolist()]

    def block(self, hash_id: int) -> tuple[int, ...]:
        return self._block(hash_id)

    def _make_block(self, hash_id: int) -> tuple[int, ...]:
        ints = self._ints
        # mooncake's generator uncached (__wrapped__): its cache of raw runs would hold fresh ints
        return tuple(ints[i] for i in block_token_ids.__wrapped__(hash_id, 0, len(ints), MOONCAKE_BLOCK_TOKENS))


def _check(num_requests: int, max_prompt_tokens: int, max_tokens: int) -> None:
    if num_requests < 1:
        raise WorkloadError(f"--num-requests must be at least 1, got {num_requests}")
    if max_prompt_tokens < 64:
        raise WorkloadError(f"--max-prompt-tokens must be at least 64, got {max_prompt_tokens}")
    if max_tokens < 1:
        raise WorkloadError(f"--max-tokens must be at least 1, got {max_tokens}")


def _jitter(rng: np.random.Generator, n: int) -> int:
    """n +- 25%, at least 1: lengths vary like real traffic but stay within the planned budget."""
    return max(1, int(n * rng.uniform(0.75, 1.0)))


def chat(src: TokenSource, num_requests: int, max_prompt_tokens: int, max_tokens: int, seed: int = 0,
         prefix: str = "chat") -> list[BenchRequest]:
    """One-shot chat: every request starts with the same system prompt (a quarter of the budget), then its
    own question (up to an eighth). No sessions."""
    _check(num_requests, max_prompt_tokens, max_tokens)
    rng = np.random.Generator(np.random.PCG64(seed))
    system = src.draw(f"system-{seed}", max_prompt_tokens // 4)
    out = []
    for i in range(num_requests):
        rid = f"{prefix}-{i}"
        question = src.draw(f"{rid}-{seed}", _jitter(rng, max_prompt_tokens // 8))
        out.append(BenchRequest(rid, "chat", tuple(system + question), max_tokens))
    return out


def _sessions(src: TokenSource, num_requests: int, turns: int, head: list[int], turn_tokens: int,
              max_tokens: int, traffic_class: str, prefix: str, seed: int, first: int) -> list[BenchRequest]:
    """Sessions of `turns` turns (the last one shorter when num_requests does not divide): turn 0 is
    `head` + `first` own tokens, each later turn adds `turn_tokens` new ones after the previous answer."""
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    out = []
    for s in range(-(-num_requests // turns)):
        sid = f"{prefix}-{s}"
        parent = None
        for t in range(min(turns, num_requests - s * turns)):
            rid = f"{sid}-t{t}"
            new = src.draw(f"{rid}-{seed}", _jitter(rng, first if t == 0 else turn_tokens))
            out.append(BenchRequest(rid, traffic_class, tuple(head + new if t == 0 else new), max_tokens,
                                    session_id=sid, user=sid, depends_on=parent))
            parent = rid
    return out


def multi_turn(src: TokenSource, num_requests: int, max_prompt_tokens: int, max_tokens: int, seed: int = 0,
               turns: int = SESSION_TURNS, prefix: str = "mt") -> list[BenchRequest]:
    """Multi-turn chat sessions: a shared system prompt (an eighth of the budget) and `turns` turns; each
    turn resends the history and the previous answer, plus a new user message. Sized so the last turn's
    prompt fits `max_prompt_tokens`."""
    _check(num_requests, max_prompt_tokens, max_tokens)
    system = src.draw(f"system-mt-{seed}", max_prompt_tokens // 8)
    per_turn = (max_prompt_tokens - len(system)) // turns - max_tokens
    if per_turn < 4:
        raise WorkloadError(f"--max-prompt-tokens {max_prompt_tokens} leaves no room for {turns} turns of "
                            f"{max_tokens} output tokens; raise it or lower --max-tokens")
    return _sessions(src, num_requests, turns, system, per_turn, max_tokens, "multi_turn", prefix, seed, per_turn)


def agent(src: TokenSource, num_requests: int, max_prompt_tokens: int, max_tokens: int, seed: int = 0,
          steps: int = SESSION_TURNS, prefix: str = "agent") -> list[BenchRequest]:
    """Agent loops: every call starts with the same long tool descriptions (half the budget), then the
    session's task; each step resends everything plus the model's last tool call and its result."""
    _check(num_requests, max_prompt_tokens, max_tokens)
    tools = src.draw(f"tools-{seed}", max_prompt_tokens // 2)
    room = max_prompt_tokens - len(tools)
    task = room // 4
    per_step = (room - task) // steps - max_tokens
    if per_step < 4:
        raise WorkloadError(f"--max-prompt-tokens {max_prompt_tokens} leaves no room for {steps} agent steps "
                            f"of {max_tokens} output tokens; raise it or lower --max-tokens")
    return _sessions(src, num_requests, steps, tools, per_step, max_tokens, "agent", prefix, seed, task)


def long_doc(src: TokenSource, num_requests: int, max_prompt_tokens: int, max_tokens: int, seed: int = 0,
             prefix: str = "doc", min_fraction: float = 0.5) -> list[BenchRequest]:
    """Unrelated long documents (`min_fraction` to all of the budget), each seen once: nothing to reuse."""
    _check(num_requests, max_prompt_tokens, max_tokens)
    rng = np.random.Generator(np.random.PCG64(seed + 2))
    out = []
    for i in range(num_requests):
        rid = f"{prefix}-{i}"
        n = int(max_prompt_tokens * rng.uniform(min_fraction, 1.0))
        out.append(BenchRequest(rid, "long_doc", tuple(src.draw(f"{rid}-{seed}", n)), max_tokens))
    return out


def parse_shares(text: str, names=SYNTHETIC, flag: str = "--mix", what: str = "class") -> dict[str, float]:
    """`"multi_turn=0.4,agent=0.3,long_doc=0.3"` -> shares (normalized later), the one parser of every flag that
    mixes named parts (`run --mix`, `compare --mix`, the fleet's `--trace source=multiplier`): each NAME one of
    `names`, each share a number >= 0 (a bare NAME: 1), at least one above 0."""
    shares = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if name not in names:
            raise WorkloadError(f"{flag}: unknown {what} {name!r} (one of {', '.join(names)})")
        try:
            shares[name] = float(value) if sep else 1.0
        except ValueError:
            raise WorkloadError(f"{flag}: {part!r} is not {what.upper()}=SHARE") from None
        if shares[name] < 0:
            raise WorkloadError(f"{flag}: share of {name} is negative")
    if not shares or sum(shares.values()) <= 0:
        example = ",".join(f"{n}=0.5" for n in list(names)[:2])
        raise WorkloadError(f"{flag}: give at least one positive share, e.g. {example}")
    return shares


def mix(src: TokenSource, num_requests: int, max_prompt_tokens: int, max_tokens: int, seed: int = 0,
        shares: dict[str, float] | None = None, makers: dict | None = None) -> list[BenchRequest]:
    """The synthetic classes together, `shares` of the requests each (largest remainder), interleaved
    in a seeded random order (a dependent turn still waits for its parent when it runs). `makers`: other
    generators by class name, called like these (loadtests/load/class_workloads.py)."""
    shares = shares or DEFAULT_SHARES
    total = sum(shares.values())
    exact = {k: num_requests * v / total for k, v in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: num_requests - sum(counts.values())]:
        counts[k] += 1
    makers = makers or {"chat": chat, "multi_turn": multi_turn, "agent": agent, "long_doc": long_doc}
    out = []
    for name, n in counts.items():
        if n:
            out += makers[name](src, n, max_prompt_tokens, max_tokens, seed)
    order = np.random.Generator(np.random.PCG64(seed + 3)).permutation(len(out))
    return [out[i] for i in order]


def build_workload(name: str, src: TokenSource, num_requests: int | None, max_prompt_tokens: int,
                   max_tokens: int, seed: int = 0, trace: str | None = None, time_scale: float = 1.0,
                   shares: dict[str, float] | None = None) -> list[BenchRequest]:
    """The named workload. Synthetic ones default to 100 requests; traces to their whole length."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")
    if name in ("mooncake", "azure-conv", "azure-code"):
        from loadtests.load import trace_workloads
        from loadtests.traces import shipped

        trace = shipped.resolve(trace or name.replace("-", "_"))  # default: the shipped trace of that name
        if name == "mooncake":
            return trace_workloads.mooncake(trace, src, num_requests, max_prompt_tokens, max_tokens, time_scale)
        return trace_workloads.azure(trace, name.replace("-", "_"), src, num_requests, max_prompt_tokens,
                                     max_tokens, time_scale)
    n = 100 if num_requests is None else num_requests
    if name == "mix":
        return mix(src, n, max_prompt_tokens, max_tokens, seed, shares)
    return {"chat": chat, "multi_turn": multi_turn, "agent": agent, "long_doc": long_doc}[name](
        src, n, max_prompt_tokens, max_tokens, seed)
