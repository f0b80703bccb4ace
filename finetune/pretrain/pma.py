"""PMA (pre-trained model averaging): the mean of the model weights of the last K checkpoints,
written as ``<output_dir>/pma/step-<N>.safetensors`` with the transformer's diffusers names.

It replaces an EMA, which would keep a second full copy of the weights on every GPU: the saved
checkpoints already are the snapshots. The mean is computed on the main process from the DCP
checkpoints, a bounded chunk of tensors at a time, so it never holds more than the accumulator
plus one chunk, on a background thread (:class:`BackgroundPMA`) while training goes on. The file's metadata ``pma_steps`` lists the averaged checkpoints' steps (JSON).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch

from krea2_diffusers.files import save_safetensors

from ..engine.checkpoint import load_in_this_process
from .architecture import AUXILIARY_MODULES

logger = logging.getLogger("finetune")

MODEL_KEY = "model"
# Names under the DCP "model" entry that are not transformer weights (the REPA projector).
AUXILIARY_PREFIXES = tuple(f"{name}." for name in AUXILIARY_MODULES)
# Elements read per DCP load call while averaging.
CHUNK_ELEMENTS = 1 << 28


def checkpoint_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Transformer weight name -> global shape, from a DCP checkpoint's metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = MODEL_KEY + "."
    return {key[len(prefix):]: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
            and not key[len(prefix):].startswith(AUXILIARY_PREFIXES)}


def load_model_tensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """float32 CPU copies of the named model tensors of one DCP checkpoint (no process group needed)."""
    tensors = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    load_in_this_process({MODEL_KEY: tensors}, path)
    return tensors


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the checkpoints' transformer weights (accumulated in float64)."""
    shapes = checkpoint_model_shapes(paths[-1])
    out: dict[str, torch.Tensor] = {}
    names = sorted(shapes)
    while names:
        chunk, size = [], 0
        while names and (not chunk or size + _numel(shapes[names[0]]) <= CHUNK_ELEMENTS):
            size += _numel(shapes[names[0]])
            chunk.append(names.pop(0))
        sums = {n: torch.zeros(shapes[n], dtype=torch.float64) for n in chunk}
        for path in paths:
            for name, tensor in load_model_tensors(path, {n: shapes[n] for n in chunk}).items():
                sums[name] += tensor
        out.update({n: (s / len(paths)).float() for n, s in sums.items()})
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_pma(checkpoints: list[tuple[int, Path]], out_dir: Path, step: int, num_checkpoints: int) -> Path:
    """Average the last ``num_checkpoints`` of ``checkpoints`` ((step, path), oldest first, up to
    ``step``) into ``out_dir/pma/step-<step>.safetensors``."""
    chosen = [(s, p) for s, p in checkpoints if s <= step][-num_checkpoints:]
    if not chosen:
        raise ValueError(f"PMA at step {step}: no checkpoint to average")
    weights = average_checkpoints([p for _, p in chosen])
    path = Path(out_dir) / "pma" / f"step-{step}.safetensors"
    save_safetensors(weights, path, metadata={"pma_steps": json.dumps([s for s, _ in chosen]), "format": "pt"})
    logger.info("PMA %s: mean of checkpoints %s", path, [s for s, _ in chosen])
    return path


class BackgroundPMA:
    """Runs :func:`write_pma` on a thread; :meth:`wait` joins it and re-raises its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, *args) -> None:
        self.wait()

        def run() -> None:
            try:
                write_pma(*args)
            except BaseException as err:  # surfaced by wait(), on the training thread
                self._error = err

        self._thread = threading.Thread(target=run, name="pma", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
