"""RoutingConfig <-> JSON-ready dicts (stored in Redis, shown in the audit log, accepted by
the admin API). Unknown keys and bad values raise RoutingConfigError with what is wrong."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gateway.routing.route_types import Pool, RoutingConfig, RoutingConfigError, Variant

_SCALARS = {f.name: f for f in dataclasses.fields(RoutingConfig) if f.name != "variants"}


def config_to_dict(config: RoutingConfig) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(config, name) for name in _SCALARS}
    out["variants"] = [
        {
            "name": v.name,
            "weight": v.weight,
            "pools": [{"engine_kind": p.engine_kind, "version": p.version} for p in v.pools],
        }
        for v in config.variants
    ]
    return out


def config_from_dict(data: dict[str, Any]) -> RoutingConfig:
    if not isinstance(data, dict):
        raise RoutingConfigError(f"routing config must be a JSON object, got {type(data).__name__}")
    unknown = set(data) - set(_SCALARS) - {"variants"}
    if unknown:
        raise RoutingConfigError(f"unknown routing config keys: {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    defaults = RoutingConfig()
    for name, value in data.items():
        if name == "variants":
            continue
        expected = type(getattr(defaults, name))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or isinstance(value, bool):
            raise RoutingConfigError(f"{name} must be a {expected.__name__}, got {value!r}")
        kwargs[name] = value
    try:
        kwargs["variants"] = tuple(
            Variant(
                name=str(v["name"]),
                weight=float(v.get("weight", 1.0)),
                pools=tuple(Pool(str(p["engine_kind"]), str(p.get("version", "*"))) for p in v["pools"]),
            )
            for v in data.get("variants", ())
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RoutingConfigError(
            f"each variant needs name, weight and pools [{{engine_kind, version}}]: {e!r}"
        ) from None
    return RoutingConfig(**kwargs).validate()


def config_to_json(config: RoutingConfig) -> str:
    return json.dumps(config_to_dict(config), sort_keys=True)


def config_from_json(text: str | bytes) -> RoutingConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RoutingConfigError(f"routing config is not valid JSON: {e}") from None
    return config_from_dict(data)
