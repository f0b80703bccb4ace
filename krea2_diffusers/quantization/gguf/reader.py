"""Reading Krea 2 GGUF files: validation plus a name -> :class:`GGUFTensor` table.

gguf-py's :class:`gguf.GGUFReader` parses the format. It fails on a bad tensor with messages
that name neither the file nor the tensor (``... is not a valid GGMLQuantizationType``,
``cannot reshape array``), so :class:`_CheckedReader` inspects each tensor-info record first
and raises :class:`GGUFFormatError` naming both.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from ...loaders.convert import DORMANT_ORIGINAL_PREFIXES, is_original_layout, strip_original_prefix
from .qtypes import READABLE_TYPES, block_geometry, type_name

Q = GGMLQuantizationType

ARCH_KEY = "general.architecture"
ORIG_SHAPE_PREFIX = "comfy.gguf.orig_shape."
# Architecture labels we accept as Krea 2. "krea2" is what our writer and ComfyUI-GGUF use.
KREA2_ARCHITECTURES = frozenset({"krea2", "krea_2", "krea-2"})
# Labels of other image models seen in community GGUF files: refused even if names overlap.
OTHER_ARCHITECTURES = frozenset({
    "flux", "sd1", "sdxl", "sd3", "aura", "hidream", "hyvid", "ltxv", "wan", "cosmos", "lumina2",
    "qwen_image", "chroma", "hunyuan", "mochi", "pixart", "sana", "llama", "qwen3", "qwen3vl",
})
# Tensor names (prefix stripped) whose presence marks the Krea 2 layouts.
ORIGINAL_SIGNATURE = ("first.weight", "tproj.1.weight", "txtfusion.projector.weight")
DIFFUSERS_SIGNATURE = ("img_in.weight", "time_mod_proj.weight", "text_fusion.projector.weight")


class GGUFFormatError(ValueError):
    """A GGUF file we cannot use; the message names the file (and the tensor when there is one)."""


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file, located but not read yet.

    Attributes:
        qtype: GGML storage type.
        shape: logical shape (``comfy.gguf.orig_shape`` when present), PyTorch order, e.g. ``(out, in)``.
        path, offset, nbytes: where its payload lies in the file.
    """

    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int

    def read_bytes(self) -> torch.Tensor:
        """The raw payload as a fresh uint8 ``(nbytes,)`` CPU tensor.

        Read with plain file reads rather than through gguf-py's memory map: touching the map
        would add the file's pages to this process's RSS on top of the copy, doubling the
        peak memory of a load.
        """
        buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.offset)
            done = 0
            while done < self.nbytes:
                n = handle.readinto(view[done:])
                if not n:
                    raise GGUFFormatError(f"{self.path}: truncated file while reading a {self.qtype.name} tensor at byte {self.offset}")
                done += n
        return buffer


class _CheckedReader(GGUFReader):
    """GGUFReader that validates each tensor-info record before gguf-py builds its view."""

    def __init__(self, path: str):
        self._path = path
        super().__init__(path)

    # gguf-py's internal step after parsing the tensor infos (checked with gguf 0.19). Should a
    # future version rename it, this check is skipped and open_reader still names the file.
    def _build_tensors(self, start_offs, fields):
        file_size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            raw = int(raw_dtype[0])
            try:
                qtype = Q(raw)
            except ValueError:
                raise GGUFFormatError(f"{self._path}: tensor {name!r} has {type_name(raw)}, which this gguf package cannot read") from None
            block_size, type_size = block_geometry(qtype)
            n_values = math.prod(int(d) for d in dims)
            end = int(start_offs + offset[0]) + n_values // block_size * type_size
            if end > file_size:
                raise GGUFFormatError(
                    f"{self._path}: truncated file: tensor {name!r} ({qtype.name}, shape {tuple(reversed(dims.tolist()))}) "
                    f"needs bytes up to {end} but the file has {file_size}"
                )
        super()._build_tensors(start_offs, fields)


def _field_value(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return [int(field.parts[i][0]) for i in field.data]
    return field.parts[field.data[0]][0]


def open_reader(path: str | os.PathLike) -> GGUFReader:
    """Parse ``path`` with gguf-py; any failure becomes a :class:`GGUFFormatError` naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _CheckedReader(path)
    except GGUFFormatError:
        raise
    except Exception as exc:  # gguf-py raises bare ValueError/IndexError/... on malformed headers
        raise GGUFFormatError(f"{path}: not a readable GGUF file (corrupt or truncated header; gguf: {type(exc).__name__}: {exc})") from exc


def _check_architecture(path: str, arch, names: set[str]) -> str:
    """Return ``"original"`` or ``"diffusers"`` (the key layout), or raise naming the file."""
    label = str(arch).lower() if arch is not None else None
    if label in OTHER_ARCHITECTURES:
        raise GGUFFormatError(f"{path}: this GGUF holds a {arch!r} model, not Krea 2 ({ARCH_KEY} = {arch!r})")
    if all(n in names for n in ORIGINAL_SIGNATURE) and is_original_layout(names):
        layout = "original"
    elif all(n in names for n in DIFFUSERS_SIGNATURE):
        layout = "diffusers"
    else:
        missing = [n for n in ORIGINAL_SIGNATURE if n not in names]
        raise GGUFFormatError(
            f"{path}: not a Krea 2 transformer ({ARCH_KEY} = {arch!r}; Krea 2 tensors missing: {missing})"
        )
    if label not in KREA2_ARCHITECTURES:
        warnings.warn(f"{path}: {ARCH_KEY} is {arch!r}, but the tensors are the Krea 2 layout; loading it as Krea 2", stacklevel=3)
    return layout


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, GGUFTensor], str, str | None]:
    """Read a Krea 2 GGUF file.

    Returns:
        ``(tensors, layout, architecture)``: tensors by name with any ``model.diffusion_model.``
        prefix removed and the dormant ``last.up/down`` tensors dropped (with a warning);
        layout is ``"original"`` or ``"diffusers"``.
    Raises:
        GGUFFormatError: another architecture, an unreadable/truncated file, an unsupported type
            (naming file and tensor).
    """
    path = os.fspath(path)
    reader = open_reader(path)
    if reader.byte_order != "I":
        raise GGUFFormatError(f"{path}: big-endian GGUF files are not supported")
    arch = _field_value(reader, ARCH_KEY)
    tensors: dict[str, GGUFTensor] = {}
    dormant = []
    for t in reader.tensors:
        name = strip_original_prefix(t.name)
        if name.startswith(DORMANT_ORIGINAL_PREFIXES):
            dormant.append(name)
            continue
        if t.tensor_type not in READABLE_TYPES:
            raise GGUFFormatError(
                f"{path}: tensor {name!r} is stored as {t.tensor_type.name}; supported types: "
                f"{', '.join(sorted(q.name for q in READABLE_TYPES))}"
            )
        orig = _field_value(reader, ORIG_SHAPE_PREFIX + t.name)
        shape = tuple(orig) if orig else tuple(int(d) for d in reversed(t.shape.tolist()))
        if math.prod(shape) != int(t.n_elements):
            raise GGUFFormatError(f"{path}: tensor {name!r}: {ORIG_SHAPE_PREFIX}{t.name} = {shape} does not match its {t.n_elements} values")
        tensors[name] = GGUFTensor(qtype=t.tensor_type, shape=shape, path=path, offset=int(t.data_offset), nbytes=int(t.n_bytes))
    if dormant:
        warnings.warn(f"{path}: ignoring {len(dormant)} unused tensor(s) the model never reads: {dormant}", stacklevel=2)
    layout = _check_architecture(path, arch, set(tensors))
    return tensors, layout, arch
