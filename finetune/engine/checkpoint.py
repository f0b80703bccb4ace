"""Sharded, atomic, resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a folder ``<output_dir>/checkpoints/step-<N>/`` (N = the optimizer step, unpadded)::

    .metadata            DCP's index: every tensor's global shape and which file holds which slice
    __<rank>_0.distcp    one file per process: its shard of the model and optimizer state, its RNG
    train_state.json     step, world size, LR schedule, data position, config fingerprint

Every process writes only what it holds (FSDP2 shards as DTensors, keyed by parameter name; a
LoRA run's model part is its trainable parameters only), so nothing is ever gathered onto one rank. Loading reshards to whatever the
current run holds, so a checkpoint written by 2 processes resumes on 1 and vice versa.

Atomicity: the folder is filled under a hidden staging name (``.step-<N>.<random>``, the project's
:func:`~krea2_diffusers.files.atomic_write_dir`) and renamed only once every process has finished
(and, for an async save, once the background write completed); :meth:`Checkpointer.latest` only
sees complete ``step-<N>`` folders. Nothing here unpickles: tensors go through DCP's tensor
storage, the run state through JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from krea2_diffusers.files import atomic_write_dir

from .parallel import trainable_state, unwrap
from .runtime import Runtime

logger = logging.getLogger("finetune")

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "train_state.json"
FORMAT_VERSION = 2
NO_GROUP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""The start of torch's "..., assuming the intent is to save / load in a single process", which it gives
at every DCP call that finds no process group, even with ``no_dist=True``. In this engine such a call is
always a one-process run or an export, so the intent is what torch assumes, and the line came back at
every checkpoint. Ignored for the whole process from here (async saves and PMA's averaging call DCP
from background threads, where a ``catch_warnings`` block is not thread-safe: one thread's exit drops
another's filter), and again around each call by :func:`single_process_intended`, for code that records
every warning (a test's ``simplefilter("always")`` takes precedence over the process-wide filter)."""
warnings.filterwarnings("ignore", message=NO_GROUP_WARNING)


class CheckpointMismatchError(ValueError):
    """A checkpoint written by another config or model; the message says what differs."""


def checkpoint_name(step: int) -> str:
    return f"step-{step}"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` as (step, path), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(folder: Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def clean_staging(folder: Path) -> None:
    """Remove staging folders a killed run left behind (hidden ``.step-*``)."""
    if folder.is_dir():
        for path in folder.glob(".step-*"):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def single_process_intended():
    """DCP calls made in here that find no process group do not warn (see :data:`NO_GROUP_WARNING`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_GROUP_WARNING)
        yield


def load_in_this_process(state: dict, path: Path) -> None:
    """``dcp.load`` of ``state`` (filled in place) from checkpoint ``path`` by this process alone, whatever
    world size wrote it and whether or not a process group exists (exports, PMA averaging)."""
    import torch.distributed.checkpoint as dcp

    with single_process_intended():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)


def read_train_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded (not full) state dicts: each rank keeps its own DTensor slices. LoRA runs skip the
    # frozen base, which the run reloads from the model file anyway (so loading is not strict).
    return StateDictOptions(full_state_dict=False, ignore_frozen_params=trainable_only, strict=not trainable_only)


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> tuple[dict, dict]:
    """(model state, optimizer state) by parameter name. A LoRA run's model state is
    :func:`~.parallel.trainable_state`: the adapters only, never a quantized base's packed weights
    or quantization state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, options = unwrap(model), _options(trainable_only)
    model_state = trainable_state(model) if trainable_only else get_model_state_dict(model, options=options)
    return model_state, get_optimizer_state_dict(model, optimizer, options=options)


class Checkpointer:
    """Save and restore model, optimizer, run state and every rank's RNG in DCP folders.

    Args:
        folder: ``<output_dir>/checkpoints``.
        keep_last: complete checkpoints kept; older ones are deleted after a new one is published.
        async_save: write in a background thread (DCP ``async_save``) while training continues;
            the checkpoint is published by the next :meth:`save` or by :meth:`wait`.
    """

    def __init__(self, folder: Path, runtime: Runtime, keep_last: int, async_save: bool = False):
        self.folder = Path(folder)
        self.runtime = runtime
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending = None  # (future, exit stack, step) of an async save not yet published
        # DCP's collectives (plan exchange, metadata gather) run on a CPU group, so an async save's
        # background thread never shares the NCCL stream with training.
        self._group = dist.new_group(backend="gloo") if runtime.world_size > 1 else None

    # ------------------------------------------------------------------ saving
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *, trainable_only: bool,
             train_state: dict[str, Any], extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Every process calls this. ``train_state``: JSON-able run state (main process's is written).
        ``extra``: more tensors by section, saved as ``<section>.<name>`` (e.g. the EMA's ``ema``)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        runtime = self.runtime
        stack = contextlib.ExitStack()
        staging = None
        if runtime.is_main:
            staging = stack.enter_context(atomic_write_dir(self.folder / checkpoint_name(step)))
            state = {**train_state, "step": step, "world_size": runtime.world_size, "format": FORMAT_VERSION,
                     "trainable_only": trainable_only}
            (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
        staging = self._broadcast_path(staging)
        model_state, optim_state = _state_dicts(model, optimizer, trainable_only)
        rng = {f"rank{runtime.rank}": rng_state(runtime.device)}
        payload = {"model": model_state, "optimizer": optim_state, "rng": rng, **(extra or {})}
        if self.async_save:
            with single_process_intended():
                future = dcp.async_save(payload, checkpoint_id=str(staging), process_group=self._group)
            self._pending = (future, stack, step)
            return
        with single_process_intended():
            dcp.save(payload, checkpoint_id=str(staging), process_group=self._group)
        self._publish(stack, step)

    def wait(self) -> None:
        """Finish and publish a pending async save (every process calls this)."""
        if self._pending is None:
            return
        future, stack, step = self._pending
        self._pending = None
        future.result()
        self._publish(stack, step)

    def _broadcast_path(self, path: Path | None) -> Path:
        if self.runtime.world_size == 1:
            return path
        box = [str(path) if path is not None else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return Path(box[0])

    def _publish(self, stack: contextlib.ExitStack, step: int) -> None:
        self.runtime.barrier()  # every shard file is complete (DCP fsyncs each one)
        if self.runtime.is_main:
            stack.close()  # rename the staging folder to step-<N>
            for _, old in list_checkpoints(self.folder)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            logger.info("checkpoint %s", self.folder / checkpoint_name(step))
        self.runtime.barrier()

    # ------------------------------------------------------------------ loading
    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, trainable_only: bool,
             expected: dict[str, Any], extra: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        """Restore ``path`` into the (already set up) model and optimizer; returns its run state.
        ``extra``: the sections :meth:`save` was given, their tensors loaded in place.

        ``expected``: run-state entries that must match (e.g. the config fingerprint, the model's
        config); a difference raises :class:`CheckpointMismatchError` naming it. The RNG of rank r
        is restored when the checkpoint had a rank r; with more processes than before, the extra
        ones keep their fresh generators (nothing they draw depends on it: noise comes from the step).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = read_train_state(path)
        differences = [f"{key}: checkpoint {state.get(key)!r} vs this run {value!r}"
                       for key, value in expected.items() if state.get(key) != value]
        if state.get("trainable_only") != trainable_only:
            differences.append(f"trainable_only: checkpoint {state.get('trainable_only')} vs this run {trainable_only}")
        if differences:
            raise CheckpointMismatchError(f"{path} was written by another config/model: " + "; ".join(differences))
        model_state, optim_state = _state_dicts(model, optimizer, trainable_only)
        payload = {"model": model_state, "optimizer": optim_state, **(extra or {})}
        has_rng = self.runtime.rank < state["world_size"]
        if has_rng:
            payload["rng"] = {f"rank{self.runtime.rank}": rng_state(self.runtime.device)}
        planner = DefaultLoadPlanner()
        with single_process_intended():
            dcp.load(payload, checkpoint_id=str(path), process_group=self._group, planner=planner)
        # DCP reads only what the run asks for: model tensors the checkpoint holds beyond that (an
        # older distillation's fake score at distribution_weight 0) are skipped, said once here.
        skipped = sorted(k for k in planner.metadata.state_dict_metadata if k.startswith("model.") and k not in planner.state_dict)
        if skipped and self.runtime.is_main:
            logger.info("%s holds %d model tensor(s) this run does not have, not loaded: %s", path, len(skipped),
                        ", ".join(k.removeprefix("model.") for k in skipped[:3]) + (", ..." if len(skipped) > 3 else ""))
        options = _options(trainable_only)
        if not trainable_only:  # a LoRA run's adapters were loaded in place (trainable_state holds the model's tensors)
            set_model_state_dict(unwrap(model), payload["model"], options=options)
        set_optimizer_state_dict(unwrap(model), optimizer, payload["optimizer"], options=options)
        if has_rng:
            set_rng_state(payload["rng"][f"rank{self.runtime.rank}"], self.runtime.device)
        return state
