"""Which `cpu` step-cost fit the simulator reads, and whether it describes the machine and dtype it is asked about.

The `cpu` cost model (cost_models.LinearCostModel) is a fit of one machine's steps, at one dtype and thread count:
a fit of an AMD Zen 4 in fp32 predicts nothing true about an Intel Xeon serving bf16 (the miss of 2026-12-06 in
docs/benchmarks.md, "advise on a capture"). So a fit records what it timed (`fit_record`) and every reader can
say whether that is this machine (`fit_report`), instead of silently predicting another one.

Which file (`fit_path`), first match wins:

1. `DUET_CPU_COST_FILE` (what `--cost-file FILE` sets for the whole process and the stacks it starts);
2. this machine's own fit in the user cache, `<cache>/cpu-cost/<vendor>-f<family>-m<model>.json`
   (`duet bench fleet-calibrate` writes there by default, so calibrating never edits the repository);
3. the repository's default, loadtests/sim/fleet/cpu_cost.json.

A CPU is named by vendor, family and model number (a VM's model name is often just "Intel(R) Xeon(R)
Processor"), and compared also on the feature flags that change a step's cost by integer factors: the bf16
instructions `--dtype auto` keys on (duet/auto_dtype.BF16_FLAGS) and the vector widths the kernels pick by.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from duet.auto_dtype import BF16_FLAGS, cpu_flags, resolve_dtype

REPO_FIT = Path(__file__).with_name("cpu_cost.json")
COST_FILE_ENV = "DUET_CPU_COST_FILE"
# the flags whose presence changes what a step costs (engine_core/cpu_linear.py, the attention kernels)
COST_FLAGS = tuple(sorted({*BF16_FLAGS, "amx_tile", "amx_int8", "avx512f", "avx512_vnni", "avx2", "fma"}))


def this_cpu(cpuinfo: str | None = None) -> dict:
    """The first CPU of /proc/cpuinfo (or of `cpuinfo`, its text): vendor, family, model number, model name and
    its COST_FLAGS; empty strings and no flags where there is no such file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return {"vendor": fields.get("vendor_id", ""), "family": fields.get("cpu family", ""),
            "model": fields.get("model", ""), "model_name": fields.get("model name", ""),
            "flags": sorted(cpu_flags(cpuinfo) & set(COST_FLAGS))}


def machine_key(cpu: dict) -> str:
    """The cache file name's stem for `cpu`: one fit per CPU kind, not per host."""
    vendor = cpu.get("vendor") or "unknown"
    return f"{vendor}-f{cpu.get('family') or 'x'}-m{cpu.get('model') or 'x'}".replace("/", "_")


def machine_fit_path(cpu: dict | None = None) -> Path:
    """Where `duet bench fleet-calibrate` writes this machine's fit by default (the user cache, never the repo)."""
    from duet.cache_dir import cache_root

    return cache_root() / "cpu-cost" / f"{machine_key(cpu or this_cpu())}.json"


def fit_path(environ=os.environ, cpu: dict | None = None) -> Path:
    """The fit the simulator reads (module docstring: the file given, this machine's own, the repository's)."""
    given = environ.get(COST_FILE_ENV, "").strip()
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{COST_FILE_ENV}={given}: no such cost fit (run `duet bench fleet-calibrate "
                                    f"--out {given}`)")
        return path
    own = machine_fit_path(cpu)
    return own if own.is_file() else REPO_FIT


def fit_source(path: Path, environ=os.environ, cpu: dict | None = None) -> str:
    """Which of fit_path's three places `path` is, in words."""
    if environ.get(COST_FILE_ENV, "").strip():
        return f"given ({COST_FILE_ENV} / --cost-file)"
    if path == machine_fit_path(cpu):
        return "this machine's own (duet bench fleet-calibrate)"
    return "the repository's default" if path == REPO_FIT else "given"


def fit_record(dtype: str, threads: int, cpuinfo: str | None = None) -> dict:
    """What a new fit records about what it timed (steps.measure writes these keys)."""
    return {"cpu": this_cpu(cpuinfo), "dtype": dtype, "threads": threads}


def differences(fit: dict, cpu: dict, auto_dtype: str | None) -> list[str]:
    """Why `fit` (a cpu_cost.json's contents) may not describe a stack on `cpu` at `auto_dtype` (what `--dtype
    auto` picks there), one sentence each; empty where it does."""
    out = []
    timed = fit.get("cpu")
    if not timed:
        out.append("the fit does not record the CPU it was measured on (fitted before fits recorded it): "
                   "run `duet bench fleet-calibrate` here")
    else:
        same_kind = all(str(timed.get(k, "")) == str(cpu.get(k, "")) for k in ("vendor", "family", "model"))
        if not same_kind:
            out.append(f"the fit was measured on {describe_cpu(timed)}; this machine is {describe_cpu(cpu)}")
        missing = sorted(set(timed.get("flags", [])) - set(cpu.get("flags", [])))
        extra = sorted(set(cpu.get("flags", [])) - set(timed.get("flags", [])))
        if missing or extra:
            out.append("CPU features differ: " + "; ".join(
                part for part in (f"the fit's CPU had {', '.join(missing)}" if missing else "",
                                  f"this one has {', '.join(extra)}" if extra else "") if part))
    dtype = fit.get("dtype")
    if dtype is None:
        out.append("the fit does not record the dtype it timed")
    elif auto_dtype is not None and dtype != auto_dtype:
        out.append(f"the fit timed {dtype}; `duet up` here computes {auto_dtype} (--dtype auto): the prediction "
                   f"is for workers started with --dtype {dtype}")
    return out


def describe_cpu(cpu: dict) -> str:
    kind = f"{cpu.get('vendor') or 'an unknown vendor'} family {cpu.get('family') or '?'} model {cpu.get('model') or '?'}"
    name = cpu.get("model_name")
    return f"{name} ({kind})" if name else kind


def fit_report(path: Path | None = None, environ=os.environ, cpuinfo: str | None = None) -> dict:
    """The fit a `cpu` prediction used against this machine: file, where it came from, what it timed, and
    `matches` (false with `differences` saying why where the fit describes another machine or dtype)."""
    cpu = this_cpu(cpuinfo)
    path = Path(path) if path is not None else fit_path(environ, cpu)
    fit = json.loads(path.read_text())
    try:
        auto = resolve_dtype("auto", "cpu", cpuinfo, environ)
    except ValueError:
        auto = None  # a bad DUET_DTYPE: the stack would refuse it, no dtype to compare
    diffs = differences(fit, cpu, auto)
    return {"file": str(path), "source": fit_source(path, environ, cpu), "measured_at": fit.get("measured_at"),
            "fit_cpu": fit.get("cpu"), "fit_dtype": fit.get("dtype"), "fit_threads": fit.get("threads"),
            "this_cpu": cpu, "auto_dtype_here": auto, "matches": not diffs, "differences": diffs}


def stack_dtype(fit: dict, checkpoint_dtype: str) -> str:
    """The dtype a stack must compute in for `fit` to describe its steps: the fit's own, or for a fit that does not
    record one, the checkpoint's (what steps.py timed before it recorded the dtype)."""
    return fit.get("dtype") or checkpoint_dtype


def stack_threads(fit: dict) -> int:
    """The torch threads per worker the fit timed (1 where it does not say)."""
    return int(fit.get("threads") or 1)


def format_warning(report: dict | None) -> list[str]:
    """Markdown lines for a report that does not match this machine (none where it does, or there is none)."""
    if not report or report["matches"]:
        return []
    head = (f"**Warning: the cpu cost fit describes another machine or dtype** ({report['file']}, {report['source']}, "
            f"measured {report['measured_at'] or 'at an unrecorded time'}); the predictions are for that machine, "
            f"not this one:")
    return [head] + [f"- {d}" for d in report["differences"]] + [""]


def use_cost_file(path: str | None, environ=os.environ) -> Path | None:
    """`--cost-file FILE`: make FILE the fit this process and every stack it starts read (COST_FILE_ENV); it must
    hold a step fit. None given: nothing changes."""
    if path is None:
        return None
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"--cost-file {path}: no such file (write one with `duet bench fleet-calibrate --out {path}`)")
    try:
        has_fit = "coefficients" in json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--cost-file {path}: not JSON ({e})") from None
    if not has_fit:
        raise ValueError(f"--cost-file {path}: holds no step fit (`coefficients`): run `duet bench fleet-calibrate "
                         f"--out {path}`")
    environ[COST_FILE_ENV] = str(file)
    return file


def format_fit(report: dict) -> list[str]:
    """Markdown lines naming the fit a prediction used and what it timed, the warning first where it is not this
    machine's."""
    cpu = report["fit_cpu"]
    timed = (f"{describe_cpu(cpu) if cpu else 'an unrecorded CPU'}, {report['fit_dtype'] or 'an unrecorded dtype'}, "
             f"{report['fit_threads'] or '?'} thread(s)")
    line = (f"Step costs: the cpu fit {report['file']} ({report['source']}): {timed}, "
            f"measured {report['measured_at'] or 'at an unrecorded time'}.")
    return format_warning(report) + [line, ""]
