"""What ``krea2 curate ingest`` reads: the sources ``krea2 pack`` reads (one reader for both).

A folder's images with same-name ``.txt`` source texts, or a JSONL / Parquet manifest of image
paths (relative to the manifest) and texts. Each becomes ``(uri, source_text)`` with the absolute
path as URI, so one file has one row however it was named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from finetune.packs.sources import source_records


def ingest_records(source: str | Path) -> Iterator[tuple[str, str | None]]:
    for record in source_records(source):
        if isinstance(record.image, bytes):
            raise ValueError(f"{source}: record {record.source or record.sample_id!r} holds image bytes; the "
                             "warehouse ingests paths (write the files out first)")
        yield str(Path(record.image).absolute()), record.caption_long
