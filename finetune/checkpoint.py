"""Atomic, resumable training checkpoints.

A checkpoint is a folder ``checkpoints/step-000120/`` holding::

    model.safetensors       trainable weights (LoRA adapters, or the whole model for full FT)
    optimizer.safetensors   optimizer tensors, keyed by parameter name (portable across world sizes)
    rng-rank<R>.safetensors each process's torch CPU (and CUDA) generator state
    state.json              step, optimizer hyper-parameters, LR-scheduler state, config hash

It is written under a temporary name and renamed into place, so a crash or ``kill -9`` leaves
either the previous checkpoint or the new one, never half of one; older ones beyond ``keep_last``
are deleted afterwards. Everything is safetensors or JSON: nothing is ever unpickled.
Noise, timesteps, caption dropout and the data order are pure functions of (seed, step), so the
step counter *is* the data position.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _flatten(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move every tensor of a nested dict/list into ``tensors`` under a dotted key; return the
    JSON-able skeleton with ``{"__tensor__": key}`` placeholders."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(tree, dict):
        return {"__dict__": [[k, _flatten(v, f"{prefix}.{k}" if prefix else str(k), tensors)] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]
    return tree


def _unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict) and "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if isinstance(skeleton, dict) and "__dict__" in skeleton:
        return {k: _unflatten(v, tensors) for k, v in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [_unflatten(v, tensors) for v in skeleton]
    return skeleton


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(folder: Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def staging_dir(folder: Path, step: int) -> Path:
    """The temporary folder checkpoint ``step`` is assembled in (same name on every process)."""
    return folder / f".tmp-step-{step:06d}"


def write_main(tmp: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict, state: dict[str, Any]) -> None:
    """Main process: weights, optimizer and run state into the staging folder."""
    save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(optimizer_state, "", tensors)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(skeleton))
    (tmp / "state.json").write_text(json.dumps(state, indent=2))


def write_rng(tmp: Path, rank: int) -> None:
    """Every process: its own generator state."""
    save_file(rng_state(), str(tmp / f"rng-rank{rank}.safetensors"))


def publish(tmp: Path, step: int, keep_last: int) -> Path:
    """Main process, after everyone wrote: fsync, rename into place, prune old checkpoints."""
    for path in tmp.iterdir():  # make the data durable before the rename publishes it
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    final = tmp.parent / f"step-{step:06d}"
    if final.exists():  # re-saving a step (e.g. the final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(tmp.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clean_staging(folder: Path) -> None:
    """Remove staging folders a killed run left behind."""
    if folder.is_dir():
        for path in folder.glob(".tmp-step-*"):
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict[str, Any]]:
    """(model weights, optimizer state, state.json) of one checkpoint folder."""
    model_state = load_file(str(path / "model.safetensors"))
    tensors = load_file(str(path / "optimizer.safetensors"))
    optimizer_state = _unflatten(json.loads((path / "optimizer.json").read_text()), tensors)
    state = json.loads((path / "state.json").read_text())
    return model_state, optimizer_state, state


def load_rng(path: Path, rank: int) -> None:
    file = path / f"rng-rank{rank}.safetensors"
    if file.exists():  # a different world size on resume: keep the fresh generators
        set_rng_state(load_file(str(file)))
