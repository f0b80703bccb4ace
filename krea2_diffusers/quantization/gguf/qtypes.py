"""The GGML tensor types this package reads and writes, with their block geometry.

A quantized GGML tensor is a row-major sequence of *blocks*; each block encodes
``block_size`` consecutive values of one row in ``type_size`` bytes. A row of ``n`` values
therefore takes ``n // block_size * type_size`` bytes and a block never crosses a row, which
is what lets a packed ``(out, in)`` weight be stored as a ``(out, row_bytes)`` uint8 tensor.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# Unquantized storage types: read as ordinary float tensors.
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})

# Block-quantized types with a torch dequantizer (see dequant.py). Weights of these types stay
# packed in memory and are expanded per layer at forward time.
PACKED_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})

READABLE_TYPES = FLOAT_TYPES | PACKED_TYPES

# What `krea2 quantize --type` offers (the community's common choices).
WRITABLE_TYPES = {"Q8_0": Q.Q8_0, "Q6_K": Q.Q6_K, "Q5_K": Q.Q5_K, "Q4_K": Q.Q4_K, "Q4_0": Q.Q4_0}


def block_geometry(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """``(values per block, bytes per block)`` of ``qtype``."""
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: GGMLQuantizationType, row_len: int) -> int:
    """Bytes one row of ``row_len`` values takes; ``row_len`` must be a whole number of blocks."""
    block_size, type_size = block_geometry(qtype)
    if row_len % block_size:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block_size} values, got {row_len}")
    return row_len // block_size * type_size


def type_name(raw: int) -> str:
    """Readable name of a raw GGML type id, also for ids this gguf version does not know."""
    try:
        return GGMLQuantizationType(raw).name
    except ValueError:
        return f"unknown type id {raw}"
