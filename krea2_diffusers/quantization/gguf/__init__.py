"""GGUF support: read community Krea 2 GGUF files with weights kept packed, and write them.

Public entry points:
- :func:`load_gguf_transformer` (called by ``Krea2Transformer2DModel.from_single_file("x.gguf")``);
- :func:`quantize_checkpoint` (behind ``krea2 quantize``);
- :class:`PackedLinear`, :func:`dequantize`, :func:`quantize` for lower-level use.

Names are imported on first use, so ``krea2 quantize --help`` (which reads ``qtypes``) needs no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GGUFFormatError": ".reader",
    "PackedLinear": ".packed",
    "dequantize": ".dequant",
    "load_gguf_transformer": ".loader",
    "quantize": ".quantizer",
    "quantize_checkpoint": ".writer",
    "read_gguf": ".reader",
    "resident_bytes": ".packed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
