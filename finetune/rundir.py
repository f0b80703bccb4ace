"""The run folder: one run per folder, and a resume must continue the same run."""

from __future__ import annotations

import json
from pathlib import Path

from .config import TrainConfig

# Settings that may change between a run and its resumption (they do not alter the maths).
_RESUMABLE_CHANGES = {"checkpointing", "validation", "export", "logging", "training.max_steps", "output_dir",
                      "data.num_workers", "data.prefetch_factor", "training.offload_blocks", "training.compile",
                      "training.activation_checkpointing"}

# Settings added after runs were recorded without them, at the value those runs trained with: left
# out of the fingerprint at that value, so such runs (and their checkpoints) still resume.
_ADDED_SETTINGS = {"training.ema.warmup": False}


# Settings whose default changed, (old default, new default): a run recorded at the old default and
# resumed from a config that leaves the setting out continues as it was recorded (its checkpoints hold
# the adapters it trained).
_CHANGED_DEFAULTS = {"lora.train_text_fusion": (False, True)}


class RunDirectoryError(ValueError):
    """The output directory holds a different run."""


def config_fingerprint(config: TrainConfig, resumable=_RESUMABLE_CHANGES) -> dict:
    """The config without the ``resumable`` settings (dotted names) and without the added settings
    at the value of the runs recorded before them, JSON-normalised."""
    raw = json.loads(json.dumps(config.to_dict()))
    for dotted in resumable:
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
    for dotted, legacy in _ADDED_SETTINGS.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and type(node.get(leaf)) is type(legacy) and node[leaf] == legacy:
            node.pop(leaf)
    return raw


def config_changes(a, b, prefix="") -> list[str]:
    """``"key: old -> new"`` for every leaf that differs between two fingerprints."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in config_changes(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix[:-1]}: {a!r} -> {b!r}"]


def check_output_dir(out: Path, config: TrainConfig, resume: bool) -> None:
    """Refuse to mix runs: a fresh run needs a directory without a run; a resume needs the same one."""
    run_file = out / "run.json"
    if not resume:
        if run_file.exists() or (out / "checkpoints").exists():
            raise RunDirectoryError(
                f"{out} already holds a training run; pass --resume to continue it, or choose another --output-dir"
            )
        return
    if run_file.exists():
        previous = json.loads(run_file.read_text())["fingerprint"]
        keep_recorded_defaults(previous, config)
        changes = config_changes(previous, config_fingerprint(config))
        if changes:
            raise RunDirectoryError(
                f"--resume: the config differs from the run in {out} in settings that change training: "
                + "; ".join(changes[:5])
            )


def keep_recorded_defaults(previous: dict, config: TrainConfig) -> None:
    """Set each setting of :data:`_CHANGED_DEFAULTS` that the resumed run recorded at its old default
    and the config now has at its new one back to the recorded value (with a printed note)."""
    for dotted, (old, new) in _CHANGED_DEFAULTS.items():
        *parents, leaf = dotted.split(".")
        node, owner = previous, config
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else {}
            owner = getattr(owner, part)
        if isinstance(node, dict) and node.get(leaf) == old and getattr(owner, leaf) == new:
            setattr(owner, leaf, old)
            print(f"--resume: {dotted} stays {old} as the run was recorded (the default is now {new})", flush=True)
