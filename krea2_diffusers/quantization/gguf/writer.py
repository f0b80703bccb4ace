"""Writing Krea 2 GGUF files from a safetensors checkpoint (``krea2 quantize``).

The output uses the community conventions (rules.py): original tensor names, small and
sensitive tensors unquantized, ``general.architecture = "krea2"`` and
``comfy.gguf.orig_shape.<name>`` for every quantized tensor. It is streamed: tensor infos are
declared first (their byte sizes follow from the shapes), then each tensor is read, quantized
and written before the next is read, so memory stays at about one tensor.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

from ...files import CheckpointError, atomic_path, read_safetensors, read_safetensors_header
from ...loaders.convert import (
    DORMANT_ORIGINAL_PREFIXES,
    UnknownKeyError,
    diffusers_module_to_original,
    strip_original_prefix,
)
from .qtypes import WRITABLE_TYPES, row_bytes
from .quantizer import quantize
from .reader import ORIG_SHAPE_PREFIX
from .rules import storage_type

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType
ARCHITECTURE = "krea2"


def _plan(path: Path, header: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """``[(source name, original name, original shape)]`` in file order, dormant tensors skipped."""
    from ...loaders.single_file import identify_layout

    original = identify_layout(list(header), path) == "original"  # another architecture is named here
    plan = []
    for src, entry in header.items():
        shape = tuple(int(d) for d in entry["shape"])
        if original:
            name = strip_original_prefix(src)
            if name.startswith(DORMANT_ORIGINAL_PREFIXES):
                logger.warning("%s: skipping unused tensor %r", path, src)
                continue
        else:
            try:
                name = diffusers_module_to_original(src)
            except UnknownKeyError:
                raise CheckpointError(f"{path}: tensor {src!r} is neither original nor diffusers Krea 2 layout") from None
            if name.endswith(".mod.lin") and len(shape) == 2:
                shape = (shape[0] * shape[1],)  # diffusers (6, D) table -> original flat (6D,)
        plan.append((src, name, shape))
    if not plan:
        raise CheckpointError(f"{path}: no tensors to quantize")
    return plan


def _encode(values: torch.Tensor, gtype: GGMLQuantizationType) -> np.ndarray:
    """Float tensor -> the numpy payload GGUFWriter expects for ``gtype``."""
    array = values.to(torch.float32).numpy()
    if gtype == Q.F32:
        return array
    if gtype == Q.F16:
        return array.astype(np.float16)
    return quantize(array, gtype) if gtype != Q.BF16 else values.to(torch.bfloat16).view(torch.uint8).numpy()


def _nbytes(gtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    return rows * row_bytes(gtype, shape[-1])


def quantize_checkpoint(src, dst, qtype: str, *, overwrite: bool = False) -> dict[str, int]:
    """Quantize a Krea 2 safetensors checkpoint (original or diffusers layout) to a GGUF file.

    Args:
        src: input ``.safetensors``.
        dst: output ``.gguf``; written through a temporary file and renamed on success.
        qtype: one of ``Q8_0``, ``Q6_K``, ``Q5_K``, ``Q4_K``, ``Q4_0``.
        overwrite: allow replacing an existing ``dst`` (never ``src``).
    Returns:
        count of tensors per written GGML type name.
    """
    src, dst = Path(src), Path(dst)
    if qtype not in WRITABLE_TYPES:
        raise ValueError(f"unknown --type {qtype!r}; choose one of {', '.join(WRITABLE_TYPES)}")
    if src.suffix != ".safetensors":
        raise CheckpointError(f"{src}: input must be a .safetensors file (other formats are not read, never unpickled)")
    if not src.is_file():
        raise FileNotFoundError(f"input checkpoint not found: {src}")
    if dst.exists() and (dst.resolve() == src.resolve() or os.path.samefile(dst, src)):
        raise CheckpointError(f"{dst}: refusing to overwrite the input checkpoint")
    if dst.exists() and not overwrite:
        raise ValueError(f"{dst} already exists; choose a new output path (or pass --force to replace it)")
    target = WRITABLE_TYPES[qtype]
    header, _, _ = read_safetensors_header(src)
    plan = _plan(src, header)
    types = {name: storage_type(name, shape, header[s]["dtype"], target) for s, name, shape in plan}

    with atomic_path(dst) as tmp:
        writer = GGUFWriter(str(tmp), arch=ARCHITECTURE)
        try:
            writer.add_quantization_version(GGML_QUANT_VERSION)
            for _, name, shape in plan:
                gtype = types[name]
                if gtype not in (Q.F32, Q.F16, Q.BF16):
                    writer.add_array(ORIG_SHAPE_PREFIX + name, list(shape))
                # GGUFWriter takes numpy-dtype hints: float ones for F32/F16, uint8 bytes for the rest.
                hint = {Q.F32: np.float32, Q.F16: np.float16}.get(gtype, np.uint8)
                byte_shape = shape if hint is not np.uint8 else (*shape[:-1], row_bytes(gtype, shape[-1]))
                writer.add_tensor_info(name, byte_shape, np.dtype(hint), _nbytes(gtype, shape), raw_dtype=None if hint is not np.uint8 else gtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for src_name, name, shape in plan:
                values = read_safetensors(src, [src_name])[src_name].reshape(shape)
                try:
                    encoded = _encode(values, types[name])
                except ValueError as err:
                    raise CheckpointError(f"{src}: tensor {src_name!r}: {err}") from None
                writer.write_tensor_data(encoded)
        finally:
            writer.close()
    return dict(Counter(t.name for t in types.values()))
