"""The ``krea2-pack-v1`` format: pre-resized, pre-shuffled, bucket-grouped Parquet for pretraining.

A pack is a folder of Parquet shards ``part-000000.parquet``, ``part-000001.parquet`` ... whose
sorted file-name order is the row order. One row per sample:

=================  ==================  =====================================================
column             type                meaning
=================  ==================  =====================================================
``sample_id``      string              unique id (a folder's relative path, a manifest's id)
``image_bytes``    binary              PNG (lossless), already resized and cropped to the bucket
``width``          int32               bucket width in pixels, a multiple of 16
``height``         int32               bucket height in pixels, a multiple of 16
``caption_long``   string, nullable    a folder's ``.txt`` caption lands here
``caption_medium`` string, nullable
``caption_short``  string, nullable
``source``         string              original path or URI
``metadata``       string              JSON text (anything the producer wants to keep)
=================  ==================  =====================================================

Rows were shuffled with ``seed`` and then grouped so that rows ``[k*B, (k+1)*B)`` share one bucket
(B = ``batch_size``): a trainer reads batch ``k`` sequentially and stacks it without padding. Every
shard holds a whole number of groups; only the pack's last group may be short (``num_rows % B``
rows). Each shard's key-value metadata repeats the pack's header (:data:`METADATA_KEYS`).

Optional columns ``text_embeds_long`` / ``_medium`` / ``_short`` hold precomputed caption features
(``krea2 pack --text-encoder``, see :mod:`finetune.packs.text_features`).
"""

from __future__ import annotations

from dataclasses import dataclass

PACK_SCHEMA = "krea2-pack-v1"
SHARD_PATTERN = "*.parquet"
SHARD_NAME = "part-{index:06d}.parquet"
SUMMARY_FILE = "pack.json"
"""Human-readable summary (counts, skipped rows by reason); readers rely on the shard metadata."""

CAPTION_COLUMNS = ("caption_long", "caption_medium", "caption_short")
COLUMNS = ("sample_id", "image_bytes", "width", "height", *CAPTION_COLUMNS, "source", "metadata")

# Parquet key-value metadata of every shard.
KEY_SCHEMA = "krea2.pack.schema"
KEY_RESOLUTION = "krea2.pack.resolution"
KEY_BATCH_SIZE = "krea2.pack.batch_size"
KEY_SEED = "krea2.pack.seed"
KEY_NUM_ROWS = "krea2.pack.num_rows"
KEY_FIRST_ROW = "krea2.pack.first_row"
METADATA_KEYS = (KEY_SCHEMA, KEY_RESOLUTION, KEY_BATCH_SIZE, KEY_SEED, KEY_NUM_ROWS, KEY_FIRST_ROW)


def arrow_schema():
    """The pyarrow schema of a shard (pyarrow imported here so the format constants stay light)."""
    import pyarrow as pa

    return pa.schema([
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("image_bytes", pa.binary(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        *(pa.field(name, pa.string(), nullable=True) for name in CAPTION_COLUMNS),
        pa.field("source", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
    ])


@dataclass(frozen=True)
class PackInfo:
    """The header every shard of a pack carries."""

    resolution: int
    batch_size: int
    seed: int
    num_rows: int
    schema: str = PACK_SCHEMA

    def key_value_metadata(self, first_row: int) -> dict[bytes, bytes]:
        values = {KEY_SCHEMA: self.schema, KEY_RESOLUTION: self.resolution, KEY_BATCH_SIZE: self.batch_size,
                  KEY_SEED: self.seed, KEY_NUM_ROWS: self.num_rows, KEY_FIRST_ROW: first_row}
        return {k.encode(): str(v).encode() for k, v in values.items()}

    @property
    def num_groups(self) -> int:
        """Groups of ``batch_size`` rows, the short last one included."""
        return -(-self.num_rows // self.batch_size)
