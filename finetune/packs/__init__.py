"""``krea2-pack-v1``: pre-resized, pre-shuffled, bucket-grouped Parquet packs for pretraining."""

from .reader import PackReader, decode_image
from .schema import CAPTION_COLUMNS, COLUMNS, PACK_SCHEMA, PackInfo
from .writer import PackError, PackRecord, PackStats, write_pack

__all__ = ["CAPTION_COLUMNS", "COLUMNS", "PACK_SCHEMA", "PackError", "PackInfo", "PackReader", "PackRecord",
           "PackStats", "decode_image", "write_pack"]
