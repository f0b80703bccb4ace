"""File primitives: atomic writes and a strict, copy-free safetensors reader.

Reading tensors straight into their final buffers (no mmap + copy) keeps the peak memory of
loading a checkpoint at about its size. Nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterator

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# A header larger than this is not a safetensors file (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A model file that cannot be used; the message names the file and the tensor at fault."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Files we publish get the ordinary permissions (0644 under umask 022), not mkstemp's 0600: a
# ComfyUI or a training job running as another user must be able to read them.
FILE_MODE = 0o666
DIR_MODE = 0o777


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed onto ``path``.

    The one atomic-write mechanism of the project: for writers that take a file name (safetensors'
    ``save_file``, ``GGUFWriter``, pyarrow). A reader never sees a half-written ``path``; on error
    (or a kill) only a hidden ``.NAME.*.tmp`` file is left, never a truncated ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, FILE_MODE & ~_umask())
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Write ``path`` through an open handle on a temporary file (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, mode) as handle:
        yield handle


@contextlib.contextmanager
def atomic_write_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Fill a temporary folder, then move it to ``path`` (which must not exist yet, or is left alone)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, DIR_MODE & ~_umask())
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.exists():
                raise
            shutil.rmtree(tmp)  # another process won the race with the same content
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def split_path_and_number(spec: str, default: float) -> tuple[str, float]:
    """``PATH`` or ``PATH:NUMBER`` (as ``--lora`` and ``--style-ref`` take them) -> (path, number).

    Splits on the last colon only when what follows parses as a number, so Windows drive letters
    (``C:\\refs\\a.png``) and colons inside file names stay in the path.
    """
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass  # the colon belongs to the path
    return spec, default


def save_safetensors(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> None:
    """Atomically write a safetensors file (streamed by safetensors, not built in memory first)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def read_safetensors_header(path) -> tuple[dict[str, dict], dict[str, str], int]:
    """Parse and validate a safetensors header.

    Returns:
        (entries, metadata, data_start): entries map name -> {"dtype", "shape", "data_offsets"}.
    Raises:
        CheckpointError: not safetensors, truncated, or inconsistent offsets; naming file and tensor.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file, or truncated (header length {header_len}, file {size} bytes)")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    data_len = size - data_start
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            numel = 1
            for dim in entry["shape"]:
                numel *= int(dim)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has an unsupported or malformed header entry {entry!r}") from None
        if end - begin != numel * dtype.itemsize or not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent byte offsets {entry['data_offsets']}")
        if end > data_len:
            raise CheckpointError(f"{path}: file is truncated: tensor {name!r} ends at byte {data_start + end}, file has {size}")
    return header, metadata, data_start


def read_bytes_into(handle, offset: int, buffer: torch.Tensor, truncated: str) -> None:
    """Fill the contiguous CPU ``buffer`` with the bytes of ``handle`` (unbuffered binary file)
    starting at ``offset``; raise :class:`CheckpointError` with ``truncated`` at an early end."""
    handle.seek(offset)
    view = memoryview(buffer.view(torch.uint8).reshape(-1).numpy())
    got = 0
    while got < len(view):
        n = handle.readinto(view[got:])
        if not n:
            raise CheckpointError(truncated)
        got += n


def read_safetensors(path, names=None, dtype_for=None) -> dict[str, torch.Tensor]:
    """Read tensors of a safetensors file directly into fresh CPU buffers.

    Args:
        names: subset of tensor names to read (default: all).
        dtype_for: optional ``callable(name, stored_dtype) -> dtype`` to cast each tensor as it is read
            (one tensor at a time, so casting never holds two copies of the file).
    """
    header, _, data_start = read_safetensors_header(path)
    wanted = list(header) if names is None else list(names)
    order = sorted(wanted, key=lambda n: header[n]["data_offsets"][0])
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as handle:
        for name in order:
            entry = header[name]
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            buffer = torch.empty(end - begin, dtype=torch.uint8)
            read_bytes_into(handle, data_start + begin, buffer, f"{path}: file is truncated inside tensor {name!r}")
            tensor = buffer.view(dtype).reshape(entry["shape"])
            target = dtype_for(name, dtype) if dtype_for else dtype
            out[name] = tensor if target == dtype else tensor.to(target)
    return out


SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# Headers are padded so tensor data starts 8-byte aligned (as the safetensors library writes them).
_HEADER_ALIGN = 8


def write_safetensors_streaming(path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], chunks,
                                metadata: dict[str, str] | None = None) -> None:
    """Atomically write a safetensors file whose tensors arrive in groups, never all in memory.

    Args:
        entries: (name, dtype, shape) of every tensor, in the order they will arrive.
        chunks: an iterable of dicts name -> tensor, together yielding every entry once, in order.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN)
    order = iter(entries)
    with atomic_write(path) as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for chunk in chunks:
            for name, tensor in chunk.items():
                expected = next(order)
                if expected[0] != name or tensor.dtype != expected[1] or tuple(tensor.shape) != tuple(expected[2]):
                    raise ValueError(f"{path}: tensor {name!r} {tensor.dtype} {tuple(tensor.shape)} arrived where "
                                     f"{expected} was announced")
                handle.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
