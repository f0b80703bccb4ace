"""GGUF support: read community Krea 2 GGUF files with weights kept packed, and write them.

Public entry points:
- :func:`load_gguf_transformer` (called by ``Krea2Transformer2DModel.from_single_file("x.gguf")``);
- :func:`quantize_checkpoint` (behind ``krea2 quantize``);
- :class:`PackedLinear`, :func:`dequantize`, :func:`quantize` for lower-level use.
"""

from .dequant import dequantize
from .loader import load_gguf_transformer
from .packed import PackedLinear, resident_bytes
from .quantizer import quantize
from .reader import GGUFFormatError, read_gguf
from .writer import quantize_checkpoint

__all__ = [
    "GGUFFormatError",
    "PackedLinear",
    "dequantize",
    "load_gguf_transformer",
    "quantize",
    "quantize_checkpoint",
    "read_gguf",
    "resident_bytes",
]
