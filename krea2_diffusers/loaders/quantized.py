"""Streamed quantized loading: the transformer's weights are read block by block and each block's
matrices are quantized (fp8 per-row scale, bitsandbytes int8 or NF4) as soon as they arrive, on
the target device when it is a GPU. The full-precision model never exists whole: the peak is the
quantized model plus one block in its stored precision plus the small non-block layers.

The one path for every quantized load: ``Krea2Transformer2DModel.from_single_file(...,
quantization=...)``, the pipeline loader (``krea2 generate --memory``, the memory presets' plan
made before loading), and ``model.quantize`` of ``krea2 train`` / ``krea2 posttrain``.
GGUF files stay packed as they are (they are quantized already).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..files import CheckpointError, read_bytes_into
from ..heap import release_freed_memory, trim_heap
from ..quantization.bnb import BNB_MODES, TRANSFORMER_KEEP, keep_filter
from ..quantization.bnb_packing import CHUNK_WEIGHTS
from .meta import check_state_dict_shapes
from .single_file import TensorLocation, locate_transformer_tensors

QUANTIZATIONS = ("fp8", *BNB_MODES)
# The units a load holds in full precision at once: one transformer or text-fusion block.
_BLOCK = re.compile(r"^((?:transformer_blocks|text_fusion\.(?:layerwise|refiner)_blocks)\.\d+)\.")
# Norm scales keep float32 (as the single-file loader keeps them) whatever torch_dtype says.
_FP32_SUFFIXES = (".norm.weight", ".norm1.weight", ".norm2.weight", ".norm_q.weight", ".norm_k.weight")


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose one of {', '.join(QUANTIZATIONS)} (or None)")


def quantize_storage_(module: nn.Module, mode: str, compute_dtype: torch.dtype) -> int:
    """Quantize ``module``'s plain ``nn.Linear`` layers (a transformer or one of its blocks) in place to
    ``mode``, except the precision-sensitive ones (``TRANSFORMER_KEEP``); returns the layers replaced."""
    check_quantization(mode)
    if mode == "fp8":
        from ..quantization.fp8 import quantize_fp8_

        return quantize_fp8_(module, TRANSFORMER_KEEP, compute_dtype)
    from ..quantization.bnb import quantize_linears_

    return quantize_linears_(module, mode, keep=TRANSFORMER_KEEP, compute_dtype=compute_dtype)


def _groups(located: dict[str, TensorLocation]) -> list[list[str]]:
    """Tensor names per block ("" for the layers outside blocks), blocks in file order."""
    groups: dict[str, list[str]] = {}
    for name in sorted(located, key=lambda n: (str(located[n].file), located[n].offset)):
        match = _BLOCK.match(name)
        groups.setdefault(match.group(1) if match else "", []).append(name)
    return list(groups.values())


def _quantized_weights(model: nn.Module) -> set[str]:
    """Names of the weights the quantizers will replace (read in their stored dtype, not cast)."""
    skip = keep_filter(TRANSFORMER_KEEP)
    return {f"{n}.weight" for n, m in model.named_modules() if type(m) is nn.Linear and not skip(n)}


def largest_quantized_weight(cls, config: dict) -> int:
    """Weights in the largest matrix of ``cls(**config)`` that the quantizers replace (the kept,
    full-precision layers such as the 6-way modulation projection are larger, but never dequantized)."""
    with torch.device("meta"):
        model = cls(**config)
    return max(model.get_submodule(name.rsplit(".", 1)[0]).weight.numel() for name in _quantized_weights(model))


def load_quantized_transformer(cls, path, quantization: str, *, torch_dtype: torch.dtype | None = None,
                               config: dict | None = None, device=None) -> nn.Module:
    """A Krea 2 transformer whose block matrices are stored as ``quantization``, streamed from ``path``.

    Args:
        path: original-layout single file or sharded index, or a diffusers ``transformer`` / pipeline folder.
        quantization: ``"fp8"`` (per-row scale, :class:`~krea2_diffusers.quantization.fp8.Fp8Linear`),
            ``"int8"`` or ``"nf4"`` (bitsandbytes; :class:`~krea2_diffusers.quantization.bnb.BitsAndBytesUnavailable`
            where it cannot run, before anything is read).
        torch_dtype: dtype of the layers kept in full precision and the quantized layers' compute
            dtype (default bfloat16); norm scales stay float32.
        device: where each block is quantized and kept (default CPU).
    Raises:
        CheckpointError: a GGUF file (already quantized), a truncated file, another architecture, or
            names / shapes that do not match the config, before any weight is read.
    """
    check_quantization(quantization)
    path = Path(path)
    if path.suffix == ".gguf":
        raise CheckpointError(f"{path}: a GGUF file is already quantized (it stays packed); load it without quantization=")
    if quantization in BNB_MODES:
        from ..quantization.bnb import require_bitsandbytes

        require_bitsandbytes()
    config, located = locate_transformer_tensors(path, config)
    with torch.device("meta"):
        model = cls(**config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # The modulation tables are stored flat (6D,) and are (6, D) in the model: same bytes, same order.
    given = {k: expected[k] if k in expected and torch.Size(loc.shape).numel() == torch.Size(expected[k]).numel()
             else loc.shape for k, loc in located.items()}
    check_state_dict_shapes(expected, given, str(path), "the Krea 2 config")
    compute = torch_dtype or torch.bfloat16
    packed = _quantized_weights(model)
    device = torch.device(device) if device is not None else torch.device("cpu")
    handles: dict[Path, object] = {}
    try:
        for names in _groups(located):
            tensors = {}
            for name in names:
                loc = located[name]
                buffer = torch.empty(loc.shape, dtype=loc.dtype)
                handle = handles.get(loc.file) or handles.setdefault(loc.file, open(loc.file, "rb", buffering=0))
                read_bytes_into(handle, loc.offset, buffer, f"{loc.file}: file is truncated inside tensor {name!r}")
                target = (loc.dtype if name in packed or not loc.dtype.is_floating_point
                          else torch.float32 if name.endswith(_FP32_SUFFIXES) else compute)
                tensors[name] = buffer.reshape(expected[name]).to(device=device, dtype=target)
                del buffer
            model.load_state_dict(tensors, assign=True, strict=False)
            del tensors
            match = _BLOCK.match(names[0])
            if match:  # a whole block: quantize it now, its full-precision matrices are freed
                quantize_storage_(model.get_submodule(match.group(1)), quantization, compute)
                # and handed back: glibc keeps them in the heap between the packed weights allocated
                # since, which no later block's matrices fit (a 12-block model peaked at 2.1x the plan).
                trim_heap()
    finally:
        for handle in handles.values():
            handle.close()
    quantize_storage_(model, quantization, compute)  # any matrix outside the blocks (none in Krea 2 today)
    release_freed_memory()  # the last blocks' full-precision buffers sit freed in the heap
    return model.eval()


def quantized_linear_bytes(in_features: int, out_features: int, mode: str, bias_bytes: int = 0) -> int:
    """Bytes of one frozen linear layer stored as ``mode``: fp8 and int8 one byte per weight plus a
    float32 scale per output row; nf4 half a byte per weight, and per 64 weights an absmax that
    bitsandbytes stores as one byte with a float32 scale per 256 of them (``compress_statistics``)."""
    weights = in_features * out_features
    if mode in ("fp8", "int8"):
        return weights + 4 * out_features + bias_bytes
    blocks = -(-weights // 64)
    return (weights + 1) // 2 + blocks + 4 * -(-blocks // 256) + bias_bytes


def planned_transformer_bytes(cls, config: dict, quantization: str | None, torch_dtype: torch.dtype) -> tuple[int, int]:
    """(resident bytes, extra peak bytes while loading) of a transformer ``cls(**config)`` loaded with
    ``quantization`` (None: every tensor in ``torch_dtype``), counted from the module tree built on
    the meta device. The extra is one block in the file's bf16 plus the quantizer's float32
    temporaries (float32 copies and the codes: ~13 bytes a weight) of one chunk of ``CHUNK_WEIGHTS``
    (every mode quantizes row chunk by row chunk: ``fp8.quantize_weight``, ``bnb_packing``)."""
    with torch.device("meta"):
        model = cls(**config)
    packed = _quantized_weights(model) if quantization else set()
    total = 0
    for name, param in model.state_dict().items():
        if name in packed:
            continue
        size = 4 if name.endswith(_FP32_SUFFIXES) or not param.is_floating_point() else torch_dtype.itemsize
        total += param.numel() * size
    largest = 0
    for name in packed:
        linear = model.get_submodule(name.rsplit(".", 1)[0])
        total += quantized_linear_bytes(linear.in_features, linear.out_features, quantization)
        largest = max(largest, linear.weight.numel())
    block = sum(p.numel() for p in model.transformer_blocks[0].parameters()) * 2
    largest = min(largest, CHUNK_WEIGHTS)
    return total, (block + 13 * largest) if quantization else 0
