"""Typed configuration parsing: a mapping (read from YAML) into nested dataclasses, and
``key=value`` overrides. Unknown keys are rejected with the closest valid name and values are
type-checked, so a typo fails before any model is loaded instead of being silently ignored. The
training run's tree (:mod:`finetune.config`), post-training's, pretraining's and the curation
warehouse's configs all parse through :func:`config_from_dict`."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

import yaml


# What YAML 1.1 (PyYAML) reads as true / false when unquoted.
YAML_TRUE = ("yes", "on", "true")
YAML_FALSE = ("no", "off", "false")


class ConfigError(ValueError):
    """A configuration problem, reported before training starts."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and value not in args:
            # YAML 1.1 reads an unquoted no / off (yes / on) as false (true): `mixed_precision: no`
            # means the choice spelled that way.
            spelled = [a for a in args if isinstance(a, str) and a.lower() in (YAML_TRUE if value else YAML_FALSE)]
            value = spelled[0] if len(spelled) == 1 else value
        if value not in args:
            hint = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            more = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}{more}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(k, args[0], where): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return config_from_dict(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads "1e-4" (no dot) as a string; accept numeric strings for floats.
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def config_from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            more = f"; did you mean '{prefix + '.' if prefix else ''}{hint[0]}'?" if hint else ""
            raise ConfigError(f"unknown config key '{where}'{more} (valid here: {', '.join(names)})")
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optimizer.learning_rate=3e-4"`` -> (["optimizer", "learning_rate"], 3e-4); the value is YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. training.max_steps=500)")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            value = float(value) if any(c.isdigit() for c in value) and value.strip() == raw.strip() else value
        except ValueError:
            pass
    return key.strip().split("."), value
