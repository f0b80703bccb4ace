"""Which tensors a Krea 2 GGUF file quantizes, following the community files (ComfyUI-GGUF,
molbal/krea2-gguf, Abiray/Krea-2-Turbo-GGUF), so that our files and theirs are interchangeable.

Names are original-layout names without prefix.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

from .qtypes import block_geometry

Q = GGMLQuantizationType

# Tensors this small (norm scales, the 12-wide text projector, ...) stay F32: quantizing them
# saves nothing and they are the most precision-sensitive.
SMALL_TENSOR_MAX_VALUES = 1024
# Input/output projections, timestep and text MLPs: a small share of the bytes but a large
# share of the error if quantized; the community keeps them unquantized.
UNQUANTIZED_PREFIXES = ("first.", "last.", "tproj.", "tmlp.", "txtmlp.", "txtfusion.projector.")
# Unquantized matrices keep their stored precision when GGUF can hold it, else F32.
FLOAT_STORAGE = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16}
# Modulation tables (``blocks.N.mod.lin``, ``last.modulation.lin``) are plain parameters that
# ComfyUI-GGUF copies raw, without dequantizing: only F32 arrives with the right shape and dtype.
MODULATION_SUFFIXES = (".mod.lin", "last.modulation.lin")


def is_small_or_table(name: str, shape: tuple[int, ...]) -> bool:
    """Vectors, tiny tensors and modulation tables: always stored F32."""
    n_values = 1
    for dim in shape:
        n_values *= dim
    return len(shape) < 2 or n_values <= SMALL_TENSOR_MAX_VALUES or name.endswith(MODULATION_SUFFIXES)


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a transformer tensor (original name, no prefix) is one of the large matrices any
    quantized format (GGUF, ComfyUI's scaled fp8) stores at low precision."""
    return not is_small_or_table(name, shape) and not name.startswith(UNQUANTIZED_PREFIXES)


def storage_type(name: str, shape: tuple[int, ...], stored_dtype: str, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The GGML type tensor ``name`` gets in a file quantized to ``qtype``.

    Args:
        name: original-layout name, no prefix.
        shape: PyTorch shape, e.g. ``(out, in)``.
        stored_dtype: safetensors dtype string of the source (``"BF16"``, ``"F32"`` ...).
        qtype: the file's quantization type.
    """
    if is_small_or_table(name, shape):
        return Q.F32
    if name.startswith(UNQUANTIZED_PREFIXES):
        return FLOAT_STORAGE.get(stored_dtype, Q.F32)
    block_size, _ = block_geometry(qtype)
    if shape[-1] % block_size:
        # K-quants need rows of 256 values; fall back to a 32-block type of similar size.
        fallback = Q.Q8_0 if qtype in (Q.Q8_0, Q.Q6_K) else Q.Q5_0 if qtype == Q.Q5_K else Q.Q4_0
        if shape[-1] % block_geometry(fallback)[0] == 0:
            return fallback
        return FLOAT_STORAGE.get(stored_dtype, Q.F32)
    return qtype
