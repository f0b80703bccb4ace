"""Building a Krea 2 transformer from a GGUF file, with quantized weights kept packed.

Steps: read and validate the file (reader.py); infer the config from the logical shapes; build
the model on the meta device (no memory); swap every ``nn.Linear`` whose weight is quantized in
the file for a :class:`PackedLinear` holding the bytes; assign the float tensors. Resident
memory is then about the file size (plus the unquantized tensors in ``torch_dtype``).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from ...loaders.convert import UnknownKeyError, convert_original_to_diffusers, original_module_to_diffusers
from .dequant import dequantize
from .packed import PackedLinear
from .qtypes import PACKED_TYPES, block_geometry
from .reader import GGUFFormatError, GGUFTensor, read_gguf

DEFAULT_DTYPE = torch.bfloat16  # the released weights' dtype; GGUF files mix several, so one must be chosen


def _diffusers_name(path: str, name: str, layout: str) -> str:
    if layout == "diffusers":
        return name
    try:
        return original_module_to_diffusers(name)
    except UnknownKeyError:
        raise GGUFFormatError(f"{path}: tensor {name!r} is not part of the Krea 2 transformer") from None


def _float_tensor(t: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """Payload as a ``dtype`` tensor of the logical shape (float types are decoded from bytes too)."""
    return dequantize(t.read_bytes(), t.qtype, t.shape, dtype)


def _keeps_fp32(name: str, keep_modules) -> bool:
    """Follows the model's ``_keep_in_fp32_modules`` (norm scales), matched on module-path parts."""
    return any(part in keep_modules for part in name.split(".")[:-1])


def _linear_at(model: nn.Module, weight_name: str) -> tuple[nn.Module, str, nn.Module] | None:
    """``(parent, child attribute, module)`` when ``weight_name`` is the weight of an ``nn.Linear``."""
    if not weight_name.endswith(".weight"):
        return None
    module_path = weight_name[: -len(".weight")]
    parent_path, _, child = module_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    module = getattr(parent, child, None)
    return (parent, child, module) if isinstance(module, nn.Linear) else None


def load_gguf_transformer(cls, path, *, config: dict | None = None, torch_dtype: torch.dtype | None = None):
    """Load a Krea 2 transformer from a GGUF file.

    Args:
        cls: the transformer class (``Krea2Transformer2DModel``), built as ``cls(**config)``.
        path: ``.gguf`` file, original (community) or diffusers tensor names.
        config: config kwargs; inferred from the tensor shapes when None.
        torch_dtype: dtype of unquantized tensors and of the forward compute (quantized weights
            are expanded to the activations' dtype); norm scales stay float32. None -> bfloat16.
    Returns:
        ``cls`` instance in eval mode, quantized linears as :class:`PackedLinear`.
    Raises:
        GGUFFormatError: wrong architecture, truncated file, unsupported type, unknown or
            missing tensors, shapes that do not fit the config (naming file and tensor).
    """
    path = os.fspath(path)
    dtype = torch_dtype or DEFAULT_DTYPE
    tensors, layout, _ = read_gguf(path)
    if config is None:
        if layout != "original":
            raise GGUFFormatError(f"{path}: a diffusers-named GGUF needs `config=` (the shapes are only mapped for original names)")
        from ...files import CheckpointError
        from ...loaders.single_file import infer_config_from_shapes

        try:
            config = infer_config_from_shapes({name: t.shape for name, t in tensors.items()})
        except CheckpointError as err:
            raise GGUFFormatError(f"{path}: {err}") from None

    with torch.device("meta"):
        model = cls(**config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    keep_fp32 = set(getattr(cls, "_keep_in_fp32_modules", None) or ())

    floats: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    for name, t in tensors.items():
        target = _diffusers_name(path, name, layout)
        if target not in expected:
            raise GGUFFormatError(f"{path}: tensor {name!r} ({target}) does not exist in the Krea 2 config {config}")
        linear = _linear_at(model, target) if t.qtype in PACKED_TYPES else None
        if linear is not None and len(t.shape) == 2 and t.shape[1] % block_geometry(t.qtype)[0] == 0:
            parent, child, meta = linear
            if t.shape != expected[target]:
                raise GGUFFormatError(f"{path}: tensor {name!r} has shape {t.shape}, the config expects {expected[target]}")
            packed = t.read_bytes().reshape(t.shape[0], -1)
            setattr(parent, child, PackedLinear(meta.in_features, meta.out_features, t.qtype, packed, bias=None))
            loaded.add(target)
            continue
        value_dtype = torch.float32 if _keeps_fp32(target, keep_fp32) else dtype
        floats[name if layout == "original" else target] = _float_tensor(t, value_dtype)

    state = convert_original_to_diffusers(floats) if layout == "original" else floats
    for target, value in state.items():
        if tuple(value.shape) != expected[target]:
            raise GGUFFormatError(f"{path}: tensor {target!r} has shape {tuple(value.shape)}, the config expects {expected[target]}")
    # A PackedLinear is built without a bias (load_state_dict finds no slot for it): attach the file's bias directly.
    for target in list(state):
        owner = _linear_at(model, target[: -len(".bias")] + ".weight") if target.endswith(".bias") else None
        if owner is not None and isinstance(owner[2], PackedLinear):
            owner[2].bias = nn.Parameter(state.pop(target), requires_grad=False)
            loaded.add(target)
    model.load_state_dict(state, strict=False, assign=True)
    loaded |= set(state)

    missing = sorted(set(expected) - loaded)
    if missing:
        raise GGUFFormatError(f"{path}: missing tensors for this config: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return model.eval()


def planned_gguf_bytes(cls, path, torch_dtype: torch.dtype | None = None) -> int:
    """Resident bytes of ``load_gguf_transformer(cls, path, torch_dtype=...)``, from the tensor
    records alone (no payload read): packed linear weights at their stored size, every other
    tensor decoded to ``torch_dtype`` (norm scales float32), as the loader keeps them."""
    path = os.fspath(path)
    dtype = torch_dtype or DEFAULT_DTYPE
    tensors, layout, _ = read_gguf(path)
    keep_fp32 = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    total = 0
    for name, t in tensors.items():
        if t.qtype in PACKED_TYPES and len(t.shape) == 2 and t.shape[1] % block_geometry(t.qtype)[0] == 0:
            total += t.nbytes  # stays packed (Krea 2 packs only linear weights)
            continue
        numel = 1
        for size in t.shape:
            numel *= size
        total += numel * (4 if _keeps_fp32(_diffusers_name(path, name, layout), keep_fp32) else dtype.itemsize)
    return total
