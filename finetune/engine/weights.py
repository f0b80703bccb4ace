"""Filling a materialised (``to_empty``) model, possibly sharded, from weights on disk: each rank
reads only the rows of each tensor that it holds.

FSDP2 shards every parameter along dim 0, so a rank's slice of a row-major tensor is one
contiguous byte range of the file: it is read straight into a buffer the size of that slice and
copied into the local shard. Peak memory is the rank's shards plus one slice, never the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol

import torch
from torch import nn

from krea2_diffusers.files import CheckpointError, read_bytes_into
from krea2_diffusers.loaders.single_file import TensorLocation


class WeightSource(Protocol):
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shape of every tensor by model name."""

    def read_rows(self, name: str, start: int, stop: int, row_shape: tuple[int, ...]) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` seen as ``(-1, *row_shape)`` (the model's shape, which
        may be a reshape of the stored one), as a CPU tensor of its stored dtype."""


class FileWeights:
    """Tensors in safetensors files, located by :func:`krea2_diffusers.loaders.single_file.locate_transformer_tensors`."""

    def __init__(self, locations: Mapping[str, TensorLocation]):
        self.locations = dict(locations)
        self._handles: dict[Path, object] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: loc.shape for name, loc in self.locations.items()}

    def read_rows(self, name: str, start: int, stop: int, row_shape: tuple[int, ...]) -> torch.Tensor:
        loc = self.locations[name]
        row = loc.dtype.itemsize * int(torch.Size(row_shape).numel())
        out = torch.empty((stop - start, *row_shape), dtype=loc.dtype)
        handle = self._handles.get(loc.file)
        if handle is None:
            handle = self._handles[loc.file] = open(loc.file, "rb", buffering=0)
        read_bytes_into(handle, loc.offset + start * row, out, f"{loc.file}: file is truncated inside tensor {name!r}")
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


class MemoryWeights:
    """Tensors already in memory (``tiny-random``, tests)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = dict(state_dict)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.state_dict.items()}

    def read_rows(self, name: str, start: int, stop: int, row_shape: tuple[int, ...]) -> torch.Tensor:
        return self.state_dict[name].reshape(-1, *row_shape)[start:stop]

    def close(self) -> None:
        pass


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(local tensor, first global row, row count) of a plain tensor or a dim-0-sharded DTensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0, tensor.shape[0] if tensor.ndim else 1
    if any(not (p.is_replicate() or (isinstance(p, Shard) and p.dim == 0)) for p in tensor.placements):
        raise NotImplementedError(f"only dim-0 sharding is read from files, got placements {tensor.placements}")
    local = tensor.to_local()
    if not tensor.ndim:
        return local, 0, 1
    # Shard(0)'s even chunking, mesh dimension by mesh dimension: ceil(rows / n) rows per rank, the
    # last ranks' chunks short or empty (torch.distributed.tensor's rule; its helper is private).
    rows, first = tensor.shape[0], 0
    coordinate = tensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            chunk = -(-rows // tensor.device_mesh.size(mesh_dim))
            start = min(chunk * coordinate[mesh_dim], rows)
            first, rows = first + start, min(rows, start + chunk) - start
    if rows != local.shape[0]:
        raise RuntimeError(f"DTensor {tuple(tensor.shape)} {tensor.placements}: {local.shape[0]} local rows, expected {rows}")
    return local, first, rows


def check_names(model: nn.Module, source: WeightSource, where: str) -> None:
    """The file must hold exactly the model's tensors, with the same shapes; otherwise say which differ."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = source.shapes()
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(set(have) - set(expected))
    wrong = [f"{k}: file {have[k]} vs model {expected[k]}" for k in expected if k in have
             and torch.Size(have[k]).numel() != torch.Size(expected[k]).numel()]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{where}: does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                              f"mis-shaped {wrong[:5]}")


@torch.no_grad()
def load_local_shards_(model: nn.Module, source: WeightSource, where: str = "weights") -> int:
    """Copy each of the model's (local shards of) tensors from ``source``; returns bytes read.

    The model must be materialised (``to_empty``); buffers that are not in its ``state_dict``
    (non-persistent ones) would stay uninitialised, so they are refused.
    """
    persistent = set(model.state_dict())
    stray = [name for name, _ in model.named_buffers() if name not in persistent]
    if stray:
        raise ValueError(f"{where}: non-persistent buffers {stray[:3]} would stay uninitialised after to_empty")
    check_names(model, source, where)
    total = 0
    for name, tensor in model.state_dict().items():
        local, start, count = local_rows(tensor)
        if local.numel() == 0:
            continue
        row_shape = tuple(tensor.shape[1:])
        rows = source.read_rows(name, start, start + count, row_shape).reshape(local.shape)
        local.copy_(rows)
        total += rows.numel() * rows.element_size()
    return total
