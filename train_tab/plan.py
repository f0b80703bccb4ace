"""The memory plan of a Train-tab run: ``krea2 train --dry-run``'s own code
(:func:`finetune.dryrun.plan_text`) on the run's config, against the GPU found, or (on a machine
without one) the card the preset is made for, or the card given with ``--train-gpu-memory``.
A run that does not fit names the presets that would.

A full-size plan builds the 12.8B model on the meta device (seconds each, and a run that does not
fit tries every preset and quantization): the last few results are kept, keyed by the config and
the base model's files (path, size, modification time), so "Start" after "Plan" costs nothing."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .presets import TRAIN_PRESETS

GIB = 1024**3
KEPT_FITS = 8
_fits: OrderedDict[str, "Fit"] = OrderedDict()
_fits_lock = threading.Lock()  # the app serves requests on several threads


@dataclass
class Fit:
    fits: bool
    text: str
    """The plan as ``--dry-run`` prints it, plus the verdict (and what to try when it does not fit)."""
    total_gib: float
    card_gib: float

    def to_json(self) -> str:
        return json.dumps({"fits": self.fits, "total_gib": round(self.total_gib, 2), "card_gib": round(self.card_gib, 2),
                           "plan": self.text})


def card(preset: str, gpu_memory_gib: float | None) -> tuple[str, int]:
    """(name, bytes) of the card the plan is for."""
    from finetune.dryrun import device_memory

    if gpu_memory_gib is not None:
        return f"a {gpu_memory_gib:g} GiB card (--train-gpu-memory)", int(gpu_memory_gib * GIB)
    name, available = device_memory()
    if available is None:
        return f"a {TRAIN_PRESETS[preset].card_gib} GiB card (the {preset} preset's; no GPU here)", TRAIN_PRESETS[preset].card_gib * GIB
    return name, available


def _files_signature(name: str) -> list:
    """(path, size, mtime) of the base model's files: a changed or replaced file is planned afresh."""
    path = Path(name)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def fit(raw_config: dict, preset: str, gpu_memory_gib: float | None, suggest=None) -> Fit:
    """The plan of ``raw_config`` (a ``krea2 train`` mapping). ``suggest(preset) -> raw config``
    builds the other presets' configs, tried when this one does not fit."""
    key = json.dumps([raw_config, preset, gpu_memory_gib, suggest is not None,
                      _files_signature(raw_config["model"]["pretrained_model_name_or_path"])], sort_keys=True, default=str)
    with _fits_lock:
        if key in _fits:
            _fits.move_to_end(key)
            return _fits[key]
    result = _planned_fit(raw_config, preset, gpu_memory_gib, suggest)
    with _fits_lock:
        _fits[key] = result
        while len(_fits) > KEPT_FITS:
            _fits.popitem(last=False)
    return result


def _planned_fit(raw_config: dict, preset: str, gpu_memory_gib: float | None, suggest) -> Fit:
    from finetune.config import build_config
    from finetune.dryrun import build_plan, plan_text

    device = card(preset, gpu_memory_gib)
    text, plan = plan_text(build_config(raw_config), device=device)
    fits = plan.total <= device[1]
    if fits:
        verdict = f"fits: {plan.total / GIB:.2f} GiB of {device[1] / GIB:.2f} GiB"
    else:
        verdict = f"DOES NOT FIT: {plan.total / GIB:.2f} GiB needed, {device[1] / GIB:.2f} GiB on the card, " \
                  f"{(plan.total - device[1]) / GIB:.2f} GiB short"
        if suggest is not None:
            others = []
            for name in TRAIN_PRESETS:
                if name == preset:
                    continue
                # only the device total is compared: build_plan alone, not plan_text's host plan and
                # its search for fitting modes (a full-size plan takes seconds, and that search ~4 more)
                other, _ = build_plan(build_config(suggest(name)), world_size=1)
                if other.total <= device[1]:
                    others.append(f"the {name} preset ({other.total / GIB:.2f} GiB)")
            verdict += "; try " + (" or ".join(others) if others else "a larger card or fewer trained layers")
    return Fit(fits, f"{verdict}\n{text}", plan.total / GIB, device[1] / GIB)
