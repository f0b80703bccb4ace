"""Writing a ``krea2-pack-v1`` pack from any iterable of records (``krea2 pack``, curation export).

Two passes over the records: the first decodes every image fully (a truncated file must be
caught before it is placed in a group) and keeps only its size; the second re-reads the kept
images in pack order, resizes and crops them to their group's bucket and writes PNG bytes.
Records are listed first (ids checked); those given as bytes stay in memory until the pack is
written, those given as paths are read from disk in each pass. ``workers`` processes decode in
parallel; the result does not depend on their number.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from PIL import Image

from krea2_diffusers.files import atomic_write_dir

from ..data.buckets import fits, make_buckets, nearest_bucket, resize_to_bucket
from .grouping import Group, group_rows
from .schema import SHARD_NAME, SUMMARY_FILE, PackInfo, arrow_schema

logger = logging.getLogger(__name__)

# Rows per shard (rounded down to whole groups) and per Parquet row group: small enough that a
# reader touches little more than the batch it needs, large enough to keep per-file overhead low.
DEFAULT_ROWS_PER_SHARD = 1024
ROWS_PER_ROW_GROUP = 64
# PNG compression: lossless at any level; level 1 is several times faster to write than the
# default 6 for about 10% larger files.
PNG_COMPRESS_LEVEL = 1
# Records handed to a worker process at a time.
MAP_CHUNK = 16


class PackError(ValueError):
    """A pack cannot be written or read; the message names the file or record at fault."""


@dataclass
class PackRecord:
    """One input sample. ``image`` is a path or the encoded file's bytes (any format PIL reads)."""

    image: str | Path | bytes
    caption_long: str | None = None
    caption_medium: str | None = None
    caption_short: str | None = None
    source: str | None = None
    """Original path/URI; defaults to ``str(image)`` for a path."""
    sample_id: str | None = None
    """Unique id; defaults to ``source``."""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class PackStats:
    out_dir: Path
    info: PackInfo
    shards: list[Path]
    skipped: dict[str, int]
    """Reason -> count (``broken image``, ...); broken inputs are never fatal."""
    buckets: dict[str, int]
    """``"WxH"`` -> rows."""

    def summary(self) -> dict[str, Any]:
        return {"schema": self.info.schema, "resolution": self.info.resolution, "batch_size": self.info.batch_size,
                "seed": self.info.seed, "num_rows": self.info.num_rows, "shards": [p.name for p in self.shards],
                "skipped": self.skipped, "buckets": self.buckets}


def _open(image: str | Path | bytes) -> Image.Image:
    return Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)


def _probe(record: PackRecord) -> tuple[int, int] | str:
    """The size, after decoding fully (``verify`` passes truncated files); or the error's text."""
    try:
        with _open(record.image) as image:
            image.load()
            return image.size
    except Exception as err:  # PIL raises many types for bad files; any of them means "skip"
        return f"{type(err).__name__}: {err}"


def _png(job: tuple[PackRecord, tuple[int, int]]) -> bytes:
    record, bucket = job
    with _open(record.image) as image:
        resized = resize_to_bucket(image.convert("RGB"), bucket)
    buffer = io.BytesIO()
    resized.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def _row(record: PackRecord, group: Group, image_bytes: bytes) -> dict[str, Any]:
    return {
        "sample_id": record.sample_id, "image_bytes": image_bytes, "width": group.bucket[0], "height": group.bucket[1],
        "caption_long": record.caption_long, "caption_medium": record.caption_medium,
        "caption_short": record.caption_short, "source": record.source,
        "metadata": json.dumps(record.metadata, sort_keys=True, default=str),
    }


def write_pack(
    records: Iterable[PackRecord],
    out_dir: str | Path,
    resolution: int,
    batch_size: int,
    seed: int = 0,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    min_aspect_ratio: float = 0.5,
    max_aspect_ratio: float = 2.0,
    extra_columns=None,
    workers: int = 1,
) -> PackStats:
    """Write ``records`` as a ``krea2-pack-v1`` pack into ``out_dir`` (which must not hold files).

    Args:
        resolution: buckets hold about ``resolution**2`` pixels (multiples of 16 per side).
        batch_size: B; rows ``[k*B, (k+1)*B)`` share one bucket. A trainer running on W processes
            with B per process reads rows ``[k*B*W, (k+1)*B*W)`` as global batch ``k``.
        rows_per_shard: rounded down to a multiple of ``batch_size`` (at least one group).
        extra_columns: optional ``callable(records, rows) -> {column: pyarrow array}`` adding
            columns to each shard (e.g. precomputed text features); its optional
            ``key_value_metadata()`` adds entries to every shard's metadata.
        workers: processes decoding and resizing images (the order and bytes do not depend on it).
    Returns:
        what was written, with the skipped inputs counted by reason.
    Raises:
        PackError: bad arguments, an existing non-empty ``out_dir``, duplicate sample ids, or no
            usable record at all.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    if batch_size < 1 or resolution < 16 or resolution % 16:
        raise PackError(f"need batch_size >= 1 and a resolution that is a multiple of 16, got batch_size={batch_size}, resolution={resolution}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise PackError(f"{out_dir} already holds files; a pack is written into a new or empty folder")
    buckets = make_buckets(resolution, 16, min_aspect_ratio, max_aspect_ratio)
    skipped: Counter[str] = Counter()
    records = list(records)
    seen: dict[str, int] = {}
    for number, record in enumerate(records):
        if record.source is None:
            record.source = f"<bytes #{number}>" if isinstance(record.image, bytes) else str(record.image)
        record.sample_id = record.sample_id or record.source
        if record.sample_id in seen:
            raise PackError(f"duplicate sample_id {record.sample_id!r} (records {seen[record.sample_id]} and {number})")
        seen[record.sample_id] = number
    stack = contextlib.ExitStack()
    pool = stack.enter_context(ProcessPoolExecutor(workers)) if workers > 1 else None

    def parallel_map(function, items):  # in order, `workers` processes decoding at once
        return pool.map(function, items, chunksize=MAP_CHUNK) if pool else map(function, items)

    kept: list[PackRecord] = []
    sizes: list[tuple[int, int]] = []
    for record, size in zip(records, parallel_map(_probe, records)):
        if isinstance(size, str):
            logger.warning("skipping broken image %s: %s", record.source, size)
            skipped["broken image"] += 1
        elif not fits(*size, nearest_bucket(*size, buckets)):
            # Upscaled pixels teach the model blur; curation drops such images, so does packing.
            skipped["smaller than its bucket"] += 1
        else:
            kept.append(record)
            sizes.append(size)
    if not kept:
        stack.close()
        raise PackError(f"no usable images ({dict(skipped) or 'the source is empty'})")

    groups = group_rows(sizes, buckets, batch_size, seed)
    info = PackInfo(resolution=resolution, batch_size=batch_size, seed=seed, num_rows=len(kept))
    per_shard = max(1, rows_per_shard // batch_size)
    schema = arrow_schema()
    shards: list[Path] = []
    bucket_rows: Counter[str] = Counter()
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above): the pack appears in one rename, never half-written
    with stack, atomic_write_dir(out_dir) as tmp:
        first_row = 0
        for shard_index, start in enumerate(range(0, len(groups), per_shard)):
            shard_groups = groups[start:start + per_shard]
            placed = [(kept[index], group) for group in shard_groups for index in group.members]
            images = parallel_map(_png, [(record, group.bucket) for record, group in placed])
            rows = [_row(record, group, image) for (record, group), image in zip(placed, images)]
            shard_records = [record for record, _ in placed]
            for group in shard_groups:
                bucket_rows[f"{group.bucket[0]}x{group.bucket[1]}"] += len(group.members)
            table = pa.Table.from_pylist(rows, schema=schema)
            if extra_columns is not None:
                for name, column in extra_columns(shard_records, rows).items():
                    table = table.append_column(name, column)
            metadata = info.key_value_metadata(first_row)
            metadata.update(getattr(extra_columns, "key_value_metadata", dict)())
            table = table.replace_schema_metadata(metadata)
            path = tmp / SHARD_NAME.format(index=shard_index)
            pq.write_table(table, path, row_group_size=ROWS_PER_ROW_GROUP // batch_size * batch_size or batch_size)
            shards.append(out_dir / path.name)
            first_row += len(rows)
        stats = PackStats(out_dir, info, shards, dict(skipped), dict(bucket_rows))
        (tmp / SUMMARY_FILE).write_text(json.dumps(stats.summary(), indent=2) + "\n")
    logger.info("wrote %d rows in %d shard(s) to %s (%s skipped)", info.num_rows, len(shards), out_dir, dict(skipped) or "none")
    return stats

