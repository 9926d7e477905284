"""Nothing under deploy/ holds a secret: keys and passwords reach the processes from the environment or
from Kubernetes Secrets, so every file there can be committed, shared and printed."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECRET_NAMES = re.compile(r"^(.*[_-])?(api_?keys?|admin_?key|password|passwd|secret|token)$", re.IGNORECASE)
ENV_REFERENCE = re.compile(r"^\$\{\w+(:?[-?][^}]*)?\}$")  # compose interpolation: ${VAR}, ${VAR:?msg}
KEY_LOOKING = re.compile(r"\bsk-[A-Za-z0-9_-]{4,}|change-?me|hunter2", re.IGNORECASE)


def _files():
    return [p for p in DEPLOY.rglob("*") if p.is_file()]


def _walk(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, (*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, str(i)))
    else:
        yield path, node


def _plain_secret(path: tuple[str, ...], value) -> bool:
    named = [p for p in path if not p.isdigit()]
    if not named or not SECRET_NAMES.match(named[-1]) or value in (None, "", [], {}) or isinstance(value, bool):
        return False
    if isinstance(value, str) and ENV_REFERENCE.match(value):
        return False  # the value comes from the environment at run time
    return path[-2:-1] != ("secretKeyRef",)  # a reference to a Kubernetes Secret's key names no value


def test_no_key_looking_strings_anywhere_in_deploy():
    for p in _files():
        text = p.read_text(errors="replace")
        hits = KEY_LOOKING.findall(text)
        assert not hits, f"{p.relative_to(DEPLOY)}: {hits}"


def test_no_secret_valued_fields_in_deploy_yaml():
    checked = 0
    for p in _files():
        if p.suffix not in (".yaml", ".yml"):
            continue
        for doc in yaml.safe_load_all(p.read_text()):
            for path, value in _walk(doc):
                assert not _plain_secret(path, value), f"{p.relative_to(DEPLOY)}: {'.'.join(path)} = {value!r}"
        checked += 1
    assert checked >= 10


def test_the_check_finds_a_planted_secret():
    doc = yaml.safe_load("auth: {admin_key: x1, api_keys: [a]}\nenv: {GRAFANA_ADMIN_PASSWORD: pw}\n")
    found = {".".join(path) for path, value in _walk(doc) if _plain_secret(path, value)}
    assert found == {"auth.admin_key", "auth.api_keys.0", "env.GRAFANA_ADMIN_PASSWORD"}
    ref = yaml.safe_load("env: {DUET_ADMIN_KEY: '${DUET_ADMIN_KEY:?set it}'}")
    assert not any(_plain_secret(p, v) for p, v in _walk(ref))
