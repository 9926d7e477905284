"""Step costs calibrated from an external backend's measured rates, for `duet bench advise` on traffic that vLLM or
SGLang servers served (no roofline or CPU fit of Duet's describes their hardware; their own rates do).

Where the rates come from: the gateway's worker rows (`GET /admin/workers`, gateway/control/admin_backend.py):
each worker's `engine` (duet, vllm, sglang, openai) and its busy prefill and decode rates. A vLLM server's two
rates come from its own /metrics counters (gateway/backends/backend_load.py `BusyRates`); an SGLang server's
prefill rate is the one this gateway observed (its queued prefill over its time to first token,
gateway/control/pool_tracker.py), and it has no decode rate at all: give one (`--backend-rates
sglang:decode=N`). Or the rates are given outright: `--backend-rates vllm:prefill=N,decode=M[,batch=B][,step_ms=S]`.

The model (`calibrate`), one `LinearCostModel` per engine kind:

    step seconds = intercept + prefill tokens x per prefill token + decode tokens x per decode token

A prefill token costs 1 / prefill rate. The decode rate is tokens per second of a step's batch (vLLM's inter-token
gap is one step), measured at a mean batch b (decode tokens a step, `decode_tokens_per_step` in the worker rows):
the measured decode step is b / decode rate, one point, and a line needs two. So the step is split under one stated
assumption: a decode token's own cost is a prefill token's (the same matrix products a token; what a decode step
costs beyond that is fixed: the weights read once, the launch, the scheduler), so per decode token = 1 / prefill
rate and intercept = b / decode rate - b / prefill rate. Where the prefill rate reads slower a token than the decode
rate (several prompts batched make it read low: backend_load.py) or b is unknown (SGLang; Duet's own workers), there
is no intercept: a decode step costs 1 / decode rate a token, in proportion to its batch (a bigger batch than the
measured one is priced dearer than it runs). `step_ms=` given replaces the split: that intercept, and the rates as
marginal costs. Attention's growth with context is not separated (the rates are the traffic's own mean context).
The output says which of these made the model, beside the rates (`MeasuredRates.source`).

Which scheduler runs for a kind: the backend's pool kind (vLLM: paged, SGLang: prefix, backend_spec.py), so vLLM
is engine_paged's scheduler with vLLM's settings (chunked prefill filling the step's token budget after the decodes,
no separate cap: `EngineProfile.paged_prefill_cap` 0; its KV block size as the page size) and SGLang is
engine_prefix's radix scheduler (at the profile's page size; SGLang's own is one token). A kind Duet's own workers
serve beside the backends is calibrated from their measured rates (GetLoad's, engine_core/step_rates.py); a kind
nobody serves (the other one of a split) is priced at the measured kind's costs: the same hardware and kernels
assumed, said in the output. The KV capacity and batch limits the gateway cannot see are the SLO profile's deployment
(EngineProfile.for_cost_model: h200 for gpu, cpu for cpu) unless `kv_tokens=` is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from duet.contract import ENGINE_KINDS, PAGED, PREFIX
from duet.traffic_classes import CPU, GPU
from loadtests.load.class_slo import ClassSlo, bounds_at, parse_class_slos
from loadtests.sim.fleet.cost_models import LinearCostModel
from loadtests.sim.fleet.engine import EngineProfile
from loadtests.sim.fleet.workload import CLASSES

EXTERNAL = ("vllm", "sglang")  # the backends whose kinds advise simulates from their rates
DEFAULT_KIND = {"vllm": PAGED, "sglang": PREFIX}  # gateway/backends/backend_spec.py DEFAULT_KIND
SCHEDULER = {PAGED: "engine_paged's scheduler with vLLM's settings (chunked prefill, no prefill cap while "
                    "decoding, the backend's block size)",
             PREFIX: "engine_prefix's radix scheduler (cache-aware admission, reuse-aware eviction)"}
PROFILE_COST_MODEL = {GPU: "h200", CPU: "cpu"}  # the deployment whose KV budget and batch limits stand in
WORKER_HOUR_USD = {GPU: 3.50, CPU: 0.05}  # as loadtests/advise/fleet.py's: an H200-hour, a CPU core-hour
RATE_KEYS = ("prefill", "decode", "batch", "step_ms", "kv_tokens")


class NoMeasuredRate(ValueError):
    """A backend the traffic went to has no measured rate yet."""


@dataclass(frozen=True)
class MeasuredRates:
    """One engine kind's rates: measured by the gateway (`workers` names the backends) or given on the command line."""

    engine: str  # vllm, sglang (or duet: Duet's own workers' rates, where a kind is theirs)
    kind: str  # the pool kind whose scheduler runs: paged or prefix
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    step_s: float = 0.0  # a per-step intercept, only where given (module doc)
    decode_batch: float = 0.0  # decode tokens a step the decode rate was measured at (0: unknown)
    workers: tuple[str, ...] = ()  # empty: given with --backend-rates
    measured_at: str = ""  # UTC time the gateway was read
    prefill_source: str = "engine"  # engine: the server's counters; gateway: the gateway's observed rate; given
    decode_source: str = "engine"
    page_size: int = 0  # the backend's KV block size (0: unknown)
    max_model_len: int = 0
    kv_tokens: int | None = None  # given only: the gateway does not see a backend's KV capacity

    def validate(self) -> MeasuredRates:
        where = f"{self.engine} ({', '.join(self.workers)})" if self.workers else self.engine
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"{where}: kind must be paged or prefix, got {self.kind!r}")
        missing = [name for name, v in (("prefill", self.prefill_tokens_per_s), ("decode", self.decode_tokens_per_s))
                   if not v > 0]
        if missing:
            how = ("SGLang's /metrics has no decode counters the gateway reads: give it, "
                   "--backend-rates sglang:decode=TOKENS_PER_S" if self.engine == "sglang" and missing == ["decode"]
                   else f"send traffic first (the gateway derives them from the backend's counters between polls), "
                        f"or give --backend-rates {self.engine}:prefill=N,decode=M")
            raise NoMeasuredRate(f"backend {where} has no measured {' or '.join(missing)} rate yet: {how}")
        if self.step_s < 0:
            raise ValueError(f"{where}: step_ms must be >= 0, got {self.step_s * 1000:g}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"{where}: kv_tokens must be >= 1, got {self.kv_tokens}")
        return self

    def source(self) -> str:
        """One line a reader of the advice can check: whose rates, when, and what the model makes of them."""
        if self.workers:
            whose = "Duet worker" if self.engine == "duet" else f"{self.engine} backend"
            head = f"calibrated from {whose} {', '.join(self.workers)}'s measured rates"
            head += f" at {self.measured_at}" if self.measured_at else ""
        else:
            head = f"calibrated from the rates given for {self.engine} (--backend-rates)"
        notes = []
        if self.prefill_source == "gateway":
            notes.append("prefill rate as the gateway observed it (its queued prefill over TTFT)")
        if self.decode_source == "given" and self.workers:
            notes.append("decode rate given (--backend-rates)")
        m = calibrate(self)
        intercept = f"{m.intercept_s * 1000:.2f} ms + " if m.intercept_s else ""
        if self.step_s:
            how = " (the step's fixed cost given)"
        elif m.intercept_s:
            how = (f" (the measured decode step, {self.decode_batch:.2f} tokens in "
                   f"{1000 * self.decode_batch / self.decode_tokens_per_s:.2f} ms, split into a fixed cost and a "
                   f"prefill token's cost a token)")
        else:
            how = (" (no per-step intercept: " + ("the decode batch is unknown" if not self.decode_batch else
                                                  "the prefill rate reads slower a token than the decode rate")
                   + "; a decode step is priced in proportion to its batch)")
        return (f"{head}: prefill {self.prefill_tokens_per_s:,.0f} tok/s, decode {self.decode_tokens_per_s:,.0f} tok/s"
                + (f" at {self.decode_batch:.2f} tokens a step" if self.decode_batch else "")
                + (f" ({'; '.join(notes)})" if notes else "") + f"; step seconds = {intercept}prefill tokens / "
                f"{1 / m.per_prefill_token_s:,.0f} + decode tokens / {1 / m.per_decode_token_s:,.0f}{how}")


def calibrate(rates: MeasuredRates) -> LinearCostModel:
    """The kind's step costs from its rates (module doc): a prefill token 1/prefill rate seconds; a decode token
    1/decode rate with `step_s` a step where that is given; else, where the decode batch b is known, the measured
    decode step (b / decode rate) split into a prefill token's cost a token and the rest a step; else no intercept.
    Attention and logits rows are in the rates already (their mean), not priced apart."""
    rates.validate()
    per_prefill, per_decode, intercept = 1.0 / rates.prefill_tokens_per_s, 1.0 / rates.decode_tokens_per_s, rates.step_s
    if not rates.step_s and rates.decode_batch > 0 and per_prefill < per_decode:
        intercept = rates.decode_batch * (per_decode - per_prefill)  # the step b/Rd = intercept + b x (1/Rp)
        per_decode = per_prefill
    return LinearCostModel(name=f"calibrated-{rates.engine}", intercept_s=intercept, per_prefill_token_s=per_prefill,
                           per_decode_token_s=per_decode, per_attended_pair_s=0.0)


@dataclass(frozen=True)
class PerKindCostModel:
    """Each engine kind's own calibrated model (the simulator asks `for_engine(kind)`: cost_models.for_engine)."""

    models: dict
    name: str = "calibrated"

    def for_engine(self, kind: str) -> LinearCostModel:
        return self.models[kind]


@dataclass(frozen=True)
class Calibration:
    """What FleetSettings.calibration carries: the per-kind cost model, the engine profile, the SLO table and
    profile, and where each part came from."""

    rates: dict  # kind -> MeasuredRates (the kinds that were measured or given)
    cost_model: PerKindCostModel
    profile: EngineProfile
    slo_profile: str
    slos: ClassSlo
    notes: tuple[str, ...] = field(default=())
    slo_source: str = "the routing config's default"  # or the gateway's routing config of the model

    def describe(self) -> dict:
        return {"kinds": {k: {"engine": r.engine, "workers": list(r.workers), "measured_at": r.measured_at,
                              "prefill_tokens_per_s": round(r.prefill_tokens_per_s, 1),
                              "decode_tokens_per_s": round(r.decode_tokens_per_s, 1),
                              "step_s": r.step_s, "decode_batch": round(r.decode_batch, 3),
                              "prefill_source": r.prefill_source,
                              "decode_source": r.decode_source, "scheduler": SCHEDULER[k],
                              "source": r.source()} for k, r in self.rates.items()},
                "step_costs": {k: {"intercept_s": m.intercept_s, "per_prefill_token_s": m.per_prefill_token_s,
                                   "per_decode_token_s": m.per_decode_token_s}
                               for k, m in self.cost_model.models.items()},
                "slo_profile": self.slo_profile, "slo_source": self.slo_source,
                "profile": {"kv_cache_tokens": self.profile.kv_cache_tokens, "max_num_seqs": self.profile.max_num_seqs,
                            "max_num_batched_tokens": self.profile.max_num_batched_tokens,
                            "max_model_len": self.profile.max_model_len, "page_size": self.profile.page_size,
                            "paged_prefill_cap": self.profile.paged_prefill_cap},
                "notes": list(self.notes)}


def build_calibration(rates: dict[str, MeasuredRates], slo_profile: str = GPU, class_slo: str | None = None,
                      slo_source: str = "the routing config's default") -> Calibration:
    """The calibration of the measured kinds' `rates` (kind -> rates); a kind not among them takes the first measured
    kind's costs (noted). SLOs: the table at `slo_profile` with `class_slo`'s overrides (--class-slo syntax)."""
    if not rates:
        raise ValueError("no backend rates to calibrate from")
    if slo_profile not in PROFILE_COST_MODEL:
        raise ValueError(f"slo profile must be one of {', '.join(PROFILE_COST_MODEL)}, got {slo_profile!r}")
    models = {k: calibrate(r) for k, r in rates.items()}
    first = next(iter(rates.values()))
    notes = []
    for kind in ENGINE_KINDS:
        if kind not in models:
            models[kind] = models[first.kind]
            notes.append(f"{kind} workers (Duet's engine_{kind}) are priced at {first.engine}'s measured step costs: "
                         f"the same hardware and kernels assumed, not measured")
    base = EngineProfile.for_cost_model(PROFILE_COST_MODEL[slo_profile])
    vllm = rates.get(PAGED) if rates.get(PAGED) and rates[PAGED].engine == "vllm" else None
    page_size = vllm.page_size if vllm and vllm.page_size else base.page_size
    lens = [r.max_model_len for r in rates.values() if r.max_model_len]
    kv = next((r.kv_tokens for r in rates.values() if r.kv_tokens), None)
    profile = replace(base, page_size=page_size, max_model_len=min(lens) if lens else base.max_model_len,
                      kv_cache_tokens=kv or base.kv_cache_tokens, paged_prefill_cap=0 if vllm else None)
    if rates.get(PREFIX) and rates[PREFIX].engine == "sglang":
        notes.append(f"SGLang's radix cache is simulated at {page_size}-token pages (its own are 1 token): a shared "
                     f"prefix counts up to its last whole page")
    if kv is None:
        notes.append(f"KV capacity and batch limits are the {PROFILE_COST_MODEL[slo_profile]} profile's "
                     f"({profile.kv_cache_tokens:,} KV tokens a worker, {profile.max_num_seqs} sequences, "
                     f"{profile.max_num_batched_tokens} tokens a step): the gateway does not see a backend's; "
                     f"give kv_tokens= in --backend-rates")
    slos = parse_class_slos(class_slo, ClassSlo(bounds_at(CLASSES, slo_profile)), CLASSES, "--class-slo")
    return Calibration(dict(rates), PerKindCostModel(models), profile, slo_profile, slos, tuple(notes), slo_source)


def parse_backend_rates(items: list[str] | None) -> dict[str, MeasuredRates]:
    """`--backend-rates ENGINE:prefill=N,decode=M[,step_ms=S][,kv_tokens=K]` (repeatable, one per engine: vllm,
    sglang) as kind -> MeasuredRates. A value left out is 0 (the gateway's, with --from-gateway)."""
    out: dict[str, MeasuredRates] = {}
    for item in items or ():
        engine, sep, body = item.partition(":")
        if not sep or engine not in EXTERNAL:
            raise ValueError(f"--backend-rates {item!r}: expected ENGINE:prefill=N,decode=M with ENGINE one of "
                             f"{', '.join(EXTERNAL)}, e.g. vllm:prefill=8000,decode=900")
        values: dict[str, float] = {}
        for part in body.split(","):
            key, eq, value = part.partition("=")
            if key not in RATE_KEYS or not eq:
                raise ValueError(f"--backend-rates {item!r}: {part!r} is not one of "
                                 f"{', '.join(k + '=N' for k in RATE_KEYS)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"--backend-rates {item!r}: {key} must be a number, got {value!r}") from None
            if values[key] <= 0 and key != "step_ms":
                raise ValueError(f"--backend-rates {item!r}: {key} must be > 0, got {value}")
        kind = DEFAULT_KIND[engine]
        if kind in out:
            raise ValueError(f"--backend-rates: {engine} given twice")
        out[kind] = MeasuredRates(engine, kind, values.get("prefill", 0.0), values.get("decode", 0.0),
                                  values.get("step_ms", 0.0) / 1000, values.get("batch", 0.0), prefill_source="given",
                                  decode_source="given",
                                  kv_tokens=int(values["kv_tokens"]) if "kv_tokens" in values else None)
    return out


def rates_from_rows(rows: list[dict], model: str | None, kinds: set[str] | None,
                    measured_at: str = "") -> dict[str, MeasuredRates]:
    """kind -> the rates of the external backends (vllm, sglang) of `model` serving that kind (`kinds`: the kinds the
    capture was served by; None: any), averaged over the backends of that kind with a rate; a backend of a kind
    with no rate at all leaves that kind's rate at 0 (validate() says to send traffic first). Where some kind is
    external, a kind only Duet's own workers serve is calibrated from their measured rates (engine_core/
    step_rates.py, the same busy rates) when they have some; with no external kind at all: {} (advise keeps its
    named cost model for Duet's own engines)."""
    out: dict[str, MeasuredRates] = {}

    def serving(r: dict, kind: str, engines) -> bool:
        return (r.get("engine") in engines and r.get("engine_kind") == kind
                and (model is None or r.get("model_id") == model) and (kinds is None or kind in kinds))

    for kind in ENGINE_KINDS:
        mine = [r for r in rows if serving(r, kind, EXTERNAL)]
        if not mine and any(serving(r, k, EXTERNAL) for r in rows for k in ENGINE_KINDS):
            mine = [r for r in rows if serving(r, kind, ("duet",)) and (r.get("prefill_tokens_per_s") or 0) > 0
                    and (r.get("decode_tokens_per_s") or 0) > 0]
        if not mine:
            continue
        engines = sorted({r["engine"] for r in mine})
        if len(engines) > 1:
            raise ValueError(f"{kind} is served by {' and '.join(engines)} backends at once: advise calibrates one "
                             f"engine a kind; give --backend-rates for the one to plan with")

        def mean(key: str, rows=mine) -> float:
            vals = [r.get(key) or 0.0 for r in rows if (r.get(key) or 0.0) > 0]
            return sum(vals) / len(vals) if vals else 0.0

        sources = {r.get("prefill_rate_source") for r in mine if (r.get("prefill_tokens_per_s") or 0) > 0}
        out[kind] = MeasuredRates(
            engines[0], kind, mean("prefill_tokens_per_s"), mean("decode_tokens_per_s"),
            workers=tuple(sorted(r["worker_id"] for r in mine)), measured_at=measured_at,
            prefill_source="gateway" if sources == {"gateway"} else "engine", decode_batch=mean("decode_tokens_per_step"),
            page_size=max((r.get("page_size") or 0) for r in mine),
            max_model_len=min((r.get("max_model_len") or 0 for r in mine if r.get("max_model_len")), default=0))
    return out


def merge_given(measured: dict[str, MeasuredRates], given: dict[str, MeasuredRates]) -> dict[str, MeasuredRates]:
    """The gateway's rates with the given ones filling in or replacing (an SGLang decode rate, a step intercept, a
    KV capacity); a given kind the gateway has no backend of stands as given."""
    out = dict(measured)
    for kind, g in given.items():
        m = measured.get(kind)
        if m is None:
            out[kind] = g
            continue
        if m.engine != g.engine:
            raise ValueError(f"--backend-rates {g.engine}: the gateway's {kind} backends are {m.engine}")
        out[kind] = replace(m, prefill_tokens_per_s=g.prefill_tokens_per_s or m.prefill_tokens_per_s,
                            prefill_source="given" if g.prefill_tokens_per_s else m.prefill_source,
                            decode_tokens_per_s=g.decode_tokens_per_s or m.decode_tokens_per_s,
                            decode_source="given" if g.decode_tokens_per_s else m.decode_source,
                            step_s=g.step_s or m.step_s, kv_tokens=g.kv_tokens or m.kv_tokens,
                            decode_batch=g.decode_batch if g.decode_tokens_per_s else m.decode_batch)
    return out


def fetch_worker_rows(gateway: str, admin_key: str | None, timeout_s: float = 30.0) -> tuple[list[dict], str]:
    """The gateway's worker rows (GET /admin/workers) and the UTC time they were read."""
    from duet.admin_get import admin_get

    r = admin_get(gateway, "/admin/workers", admin_key, timeout_s)
    return r.json().get("workers", []), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def fetch_slo_profile(gateway: str, admin_key: str | None, model: str | None, timeout_s: float = 30.0) -> str:
    """The SLO profile the gateway holds `model`'s requests to (its routing config's `slo_profile`); the routing
    config's default when the model is unknown."""
    from duet.admin_get import admin_get
    from gateway.routing.route_types import RoutingConfig

    if not model:
        return RoutingConfig().slo_profile
    r = admin_get(gateway, f"/admin/models/{model}/routing", admin_key, timeout_s)
    return r.json().get("slo_profile", RoutingConfig().slo_profile)


def from_gateway(gateway: str, admin_key: str | None, mix: dict, given: dict[str, MeasuredRates] | None = None,
                 class_slo: str | None = None, required: bool = False) -> Calibration | None:
    """The calibration of a gateway's external backends (those of the capture's model and kinds, when the trace
    `mix` is a capture), with `given` rates filling in; None where no vLLM or SGLang backend served the traffic and
    none is `required` (Duet's own engines served it: advise keeps its named cost model)."""
    from loadtests.advise.fleet import served_by

    model, kinds = served_by(mix)
    rows, at = fetch_worker_rows(gateway, admin_key)
    measured = rates_from_rows(rows, model, kinds or None, at)
    if not measured and not given:
        if not required:
            return None
        raise ValueError(f"the gateway at {gateway} has no vLLM or SGLang backend"
                         + (f" serving {model}" if model else "") + ": nothing to calibrate from")
    slo_profile = fetch_slo_profile(gateway, admin_key, model)
    source = f"the gateway's routing config for {model}" if model else "the routing config's default"
    return build_calibration(merge_given(measured, given or {}), slo_profile, class_slo, source)
