"""``krea2-pack-v1``: pre-resized, pre-shuffled, bucket-grouped Parquet packs for pretraining.

Names are resolved on first use so that ``krea2 pack --help`` (which imports this package for its
parser) does not pull in torch or pyarrow.
"""

import importlib

_EXPORTS = {
    "PackReader": "reader", "decode_image": "reader",
    "CAPTION_COLUMNS": "schema", "COLUMNS": "schema", "PACK_SCHEMA": "schema", "PackInfo": "schema",
    "PackError": "writer", "PackRecord": "writer", "PackStats": "writer", "write_pack": "writer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
