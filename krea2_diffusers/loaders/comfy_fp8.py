"""ComfyUI's scaled-fp8 checkpoint FORMAT: reading it (keep fp8 + scales, or dequantize) and writing it.

A layer ``L`` stored in fp8 has ``L.weight`` (float8_e4m3fn) and a float32 scalar ``L.weight_scale``
(dequantized weight = fp8 * scale), optionally ``L.input_scale`` (activation scale; unused for
bf16 compute). Which layers are fp8 is declared by one of:

- safetensors metadata ``_quantization_metadata`` = ``{"format_version": "1.0", "layers": {L: {"format": "float8_e4m3fn"}}}``;
- a ``L.comfy_quant`` uint8 tensor holding that per-layer JSON (ComfyUI's in-file variant);
- the older form: ``L.scale_weight`` (and ``L.scale_input``) plus a ``scaled_fp8`` marker tensor.

The runtime layer is :class:`krea2_diffusers.quantization.fp8.Fp8Linear`; this module only knows the file format.
"""

from __future__ import annotations

import json
from typing import Callable, Mapping

import torch

from ..files import CheckpointError
from ..quantization.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight
from .convert import (
    DORMANT_ORIGINAL_PREFIXES,
    UnknownKeyError,
    diffusers_module_to_original,
    is_original_layout,
    strip_original_prefix,
)

FORMAT_KEY = "_quantization_metadata"
FORMAT_VERSION = "1.0"
# The Qwen3-VL text encoder's token embeddings in Hugging Face layout: a file holding it is a text
# encoder (see looks_like_text_encoder; loaders.text_encoder imports it from here).
EMBEDDINGS = "model.language_model.embed_tokens.weight"
FP8_FORMAT = "float8_e4m3fn"
SAFETENSORS_FP8 = "F8_E4M3"
# Tensor-name endings that are format bookkeeping, not model weights, and the marker of the old form.
WEIGHT_SCALE, INPUT_SCALE, LAYER_CONF = ".weight_scale", ".input_scale", ".comfy_quant"
OLD_WEIGHT_SCALE, OLD_INPUT_SCALE, OLD_MARKER = ".scale_weight", ".scale_input", "scaled_fp8"
_AUXILIARY = (WEIGHT_SCALE, INPUT_SCALE, LAYER_CONF, OLD_WEIGHT_SCALE, OLD_INPUT_SCALE)


def is_auxiliary(name: str) -> bool:
    """Whether tensor ``name`` is part of the fp8 format (a scale, a layer config or the old marker)."""
    return name.endswith(_AUXILIARY) or name == OLD_MARKER or name.endswith("." + OLD_MARKER)


def is_scaled_fp8(header: Mapping[str, dict], metadata: Mapping[str, str]) -> bool:
    """Whether a safetensors header (entries with "dtype") describes a ComfyUI fp8 file."""
    return FORMAT_KEY in metadata or any(
        entry.get("dtype") == SAFETENSORS_FP8 or is_auxiliary(name) for name, entry in header.items())


def _scale_of(layer: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    for suffix in (WEIGHT_SCALE, OLD_WEIGHT_SCALE):
        if layer + suffix in tensors:
            return tensors[layer + suffix]
    return None


def split_scales(tensors: Mapping[str, torch.Tensor], source: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Separate model weights from the format's bookkeeping.

    Args:
        tensors: every tensor of the file (or of one shard), by name.
        source: the file, for error messages.
    Returns:
        (weights, scales): ``weights`` without any format tensor; ``scales`` maps each fp8 layer
        (the weight's name without ``.weight``) to its float32 scale (scalar or per row).
    Raises:
        CheckpointError: an fp8 weight without a scale, or a scale without its weight.
    """
    for name, conf in tensors.items():
        if name.endswith(LAYER_CONF):  # ComfyUI's in-file per-layer config: only float8_e4m3fn is read here
            fmt = json.loads(bytes(conf.to(torch.uint8).tolist()).decode()).get("format")
            if fmt != FP8_FORMAT:
                raise CheckpointError(f"{source}: layer {name.removesuffix(LAYER_CONF)!r} is quantized as {fmt!r}; "
                                      f"only ComfyUI's {FP8_FORMAT!r} is supported")
    weights = {k: v for k, v in tensors.items() if not is_auxiliary(k)}
    scales = {}
    for name, tensor in weights.items():
        if tensor.dtype != FP8_DTYPE:
            continue
        layer = name.removesuffix(".weight")
        scale = _scale_of(layer, tensors)
        if scale is None:
            raise CheckpointError(f"{source}: tensor {name!r} is float8 but its scale {layer + WEIGHT_SCALE!r} is missing "
                                  "(not a complete ComfyUI scaled-fp8 file)")
        scales[layer] = scale.float()
    for name in tensors:
        for suffix in (WEIGHT_SCALE, OLD_WEIGHT_SCALE):
            if name.endswith(suffix) and name[: -len(suffix)] not in scales:
                raise CheckpointError(f"{source}: scale {name!r} has no float8 weight {name[: -len(suffix)] + '.weight'!r}")
    return weights, scales


def dequantize(weights: dict[str, torch.Tensor], scales: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Replace each fp8 ``L.weight`` by ``fp8 * scale`` in ``dtype`` (in place; returns ``weights``).

    ``dtype`` None: the dtype of the file's other floating tensors (bf16 in ComfyUI's files).
    """
    if dtype is None:
        others = [t.dtype for t in weights.values() if t.is_floating_point() and t.dtype != FP8_DTYPE]
        dtype = max(set(others), key=others.count) if others else torch.bfloat16
    for layer, scale in scales.items():
        weights[layer + ".weight"] = dequantize_weight(weights[layer + ".weight"], scale, dtype)
    return weights


def looks_like_text_encoder(header: dict) -> bool:
    """Whether a safetensors header is a Hugging Face-layout Qwen3-VL (for ``krea2 quantize``).
    Here, not in :mod:`.text_encoder` (which imports this module): no import circle."""
    return EMBEDDINGS in header


def _fp8_plan(src, header: dict) -> tuple[str, dict[str, str], Callable[[str, tuple], bool]]:
    """(kind, output name per source name, which output tensors to quantize) for a transformer or text encoder file."""
    from ..quantization.gguf.rules import is_quantizable

    if looks_like_text_encoder(header):
        # The language model's matrices; embeddings, LM head and the vision tower stay as they are.
        names = {k: k for k in header}
        return "text encoder", names, lambda n, shape: n.startswith("model.language_model.layers.") and len(shape) == 2
    if is_original_layout(header):
        names = {k: k for k in header if not strip_original_prefix(k).startswith(DORMANT_ORIGINAL_PREFIXES)}
    else:
        try:
            names = {k: diffusers_module_to_original(k) for k in header}
        except UnknownKeyError as err:
            raise CheckpointError(f"{src}: neither a Krea 2 transformer nor a Qwen3-VL text encoder ({err})") from None
    return "transformer", names, lambda n, shape: is_quantizable(strip_original_prefix(n), shape)


def quantize_checkpoint_fp8(src, dst, *, overwrite: bool = False) -> dict[str, int]:
    """Write a transformer (original or diffusers layout; written in the original layout that ComfyUI's
    UNETLoader reads) or a Qwen3-VL text encoder file in ComfyUI's scaled-fp8 format.

    Tensors are read one at a time; memory peaks at about the output's size.
    Returns:
        {"fp8": layers quantized, "kept": tensors kept as they were}.
    """
    from pathlib import Path

    from ..files import read_safetensors, read_safetensors_header, save_safetensors

    src, dst = Path(src), Path(dst)
    if src.suffix != ".safetensors" or not src.is_file():
        raise CheckpointError(f"{src}: input must be an existing .safetensors file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: refusing to overwrite the input checkpoint")
    if dst.exists() and not overwrite:
        raise ValueError(f"{dst} already exists; choose a new output path (or pass --force to replace it)")
    header, metadata, _ = read_safetensors_header(src)
    if is_scaled_fp8(header, metadata):
        raise CheckpointError(f"{src}: already a scaled-fp8 file")
    kind, names, selected = _fp8_plan(src, header)
    out, layers = {}, {}
    for name, new in names.items():
        tensor = read_safetensors(src, [name])[name]
        if new.endswith(".mod.lin") and tensor.ndim == 2:
            tensor = tensor.reshape(-1)  # diffusers (6, D) table -> original flat (6D,)
        if new.endswith(".weight") and tensor.ndim == 2 and tensor.is_floating_point() and selected(new, tuple(tensor.shape)):
            layer = new.removesuffix(".weight")
            # ComfyUI's format: one scalar scale per tensor.
            out[new], out[layer + WEIGHT_SCALE] = quantize_weight(tensor, per_row=False)
            layers[layer] = {"format": FP8_FORMAT}
        else:
            out[new] = tensor
    meta = {"format": "pt", FORMAT_KEY: json.dumps({"format_version": FORMAT_VERSION, "layers": layers})}
    save_safetensors(out, dst, metadata=meta)
    return {"fp8": len(layers), "kept": len(out) - 2 * len(layers), "kind": kind}
