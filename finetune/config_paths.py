"""Paths in a YAML config: a relative path written in the file is resolved against the file's own
directory, the convention of YAML-driven trainers, so a config runs the same from any working
directory (the app's Train tab starts ``krea2 train RUN/train.yaml`` inside the run folder).

Which keys hold paths is said where they are declared, in their dataclass field's metadata:
:data:`PATH` (a file or folder: ``output_dir``, ``data.path``, ``data.datasets[].path``,
``data.masks`` when it names a folder, ``data.cache_dir``, ``validation.reference_images``, DPO's
``data`` and ``cache_dir``, ``prompts_file``) and :data:`MODEL_NAME` (``model.*``: a file or
folder, or a hub id such as ``krea/Krea-2-Raw``, or ``tiny-random``).

The rules (:func:`resolve_path`, :func:`resolve_name`):

* an absolute path is kept (``~`` is expanded first);
* a relative :data:`PATH` becomes ``<config dir>/<path>``;
* a relative :data:`MODEL_NAME` becomes ``<config dir>/<name>`` when that exists or the name is
  written as a relative path (``./x``, ``../x``); otherwise it is kept as given: a hub id (which
  holds a slash too), ``tiny-random``, or a path taken from the working directory as before.

Only what the file says is resolved: a ``key=value`` override on the command line (and
``--output-dir``) is a path as the shell gives it, relative to the working directory, and a default
left unset (``output_dir: outputs/krea2-lora``) is too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union

from krea2_diffusers.models.tiny import is_tiny

PATH = {"config_path": "path"}
"""Field metadata: the value names a file or folder (a string, or lists of strings)."""
MODEL_NAME = {"config_path": "name"}
"""Field metadata: the value names a model: a file or folder, a hub id or ``tiny-random``."""
NOTE = "A relative path in a YAML config is resolved against the config file's directory."


def resolve_path(value: str, base: Path) -> str:
    """``value`` (a file or folder) as an absolute path, a relative one taken from ``base``; "" stays ""."""
    if not value:
        return value
    path = Path(value).expanduser()
    return str(path) if path.is_absolute() else os.path.normpath(base / path)


def resolve_name(name: str, base: Path) -> str:
    """A model name as an absolute path when it is a local one (see the module docstring): relative
    names are taken from ``base`` when they exist there or are written ``./x`` / ``../x``; hub ids,
    ``tiny-random`` and names found nowhere under ``base`` are kept as given."""
    if not name or is_tiny(name):
        return name
    path = Path(name).expanduser()
    if path.is_absolute():
        return str(path)
    if name.startswith(("./", "../")) or os.path.lexists(base / path):
        return os.path.normpath(base / path)
    return name


def _resolved(value: Any, kind: str, base: Path) -> Any:
    if isinstance(value, str):
        return resolve_path(value, base) if kind == "path" else resolve_name(value, base)
    if isinstance(value, list):
        return [_resolved(v, kind, base) for v in value]
    return value  # not a path (data.masks: true) or the wrong type, which the parser reports


def _nested(tp: Any) -> tuple[type | None, bool]:
    """(the dataclass inside ``tp``, whether ``tp`` is a list of it): ``X | None`` -> (X, False),
    ``list[X]`` -> (X, True), anything else -> (None, False)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _nested(arg)
            if found[0] is not None:
                return found
        return None, False
    if origin is list:
        inner = typing.get_args(tp)[0]
        return (inner, True) if dataclasses.is_dataclass(inner) else (None, False)
    return (tp, False) if dataclasses.is_dataclass(tp) else (None, False)


def resolve_config_paths(cls: type, raw: dict, base: Path, prefix: str = "") -> list[tuple[str, str]]:
    """Resolve, in place, the path-valued keys of ``raw`` (a YAML mapping for dataclass ``cls``)
    against ``base``; returns (dotted key, new value) for each one changed. Unknown keys and values
    of the wrong type are left to the parser, which reports them."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    changed: list[tuple[str, str]] = []
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            continue
        kind = fields[key].metadata.get("config_path")
        if kind is not None:
            new = _resolved(value, kind, base)
            if new != value:
                raw[key] = new
                changed.append((where, new))
            continue
        inner, is_list = _nested(hints[key])
        if inner is None:
            continue
        if is_list and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    changed += resolve_config_paths(inner, item, base, f"{where}[{i}]")
        elif not is_list and isinstance(value, dict):
            changed += resolve_config_paths(inner, value, base, where)
    return changed


def report(changed: list[tuple[str, str]], base: Path, stream=None) -> None:
    """Say so (on stderr) when a config's relative paths were resolved: :data:`NOTE`, then each key."""
    if changed:
        print(f"{NOTE} ({base})", file=stream or sys.stderr)
        for key, value in changed:
            print(f"  {key}: {value}", file=stream or sys.stderr)
