"""What ``krea2 pack`` reads: a folder of images with same-name ``.txt`` captions, a JSONL manifest
or a Parquet table, turned into :class:`PackRecord` s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ..data import IMAGE_EXTENSIONS
from .schema import CAPTION_COLUMNS
from .writer import PackError, PackRecord

# Manifest fields: the image, then the captions (a plain `caption`/`text` is the long one).
IMAGE_FIELDS = ("path", "image", "file_name")
LONG_CAPTION_ALIASES = ("caption", "text")
_KNOWN = set(IMAGE_FIELDS) | set(LONG_CAPTION_ALIASES) | set(CAPTION_COLUMNS) | {"sample_id", "source", "metadata"}


def folder_records(folder: Path) -> Iterator[PackRecord]:
    """Every image under ``folder`` (sorted); a same-name ``.txt`` fills ``caption_long``."""
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS):
        caption = path.with_suffix(".txt")
        yield PackRecord(
            image=path, caption_long=caption.read_text(encoding="utf-8").strip() if caption.is_file() else None,
            source=str(path), sample_id=str(path.relative_to(folder)),
        )


def _manifest_record(row: dict[str, Any], base: Path, where: str) -> PackRecord:
    image = next((row[k] for k in IMAGE_FIELDS if row.get(k)), None)
    if image is None:
        raise PackError(f"{where}: row has none of the image fields {IMAGE_FIELDS}")
    if isinstance(image, (bytes, bytearray)):
        source = row.get("source") or row.get("sample_id")
    else:
        image = base / image
        source = row.get("source") or str(image)
    long = row.get("caption_long") or next((row[k] for k in LONG_CAPTION_ALIASES if row.get(k)), None)
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    metadata.update({k: v for k, v in row.items() if k not in _KNOWN})
    return PackRecord(image=bytes(image) if isinstance(image, bytearray) else image, caption_long=long,
                      caption_medium=row.get("caption_medium"), caption_short=row.get("caption_short"),
                      source=source, sample_id=row.get("sample_id"), metadata=metadata)


def manifest_records(path: Path) -> Iterator[PackRecord]:
    """Rows of a ``.jsonl`` / ``.parquet`` manifest: an image path (relative to the manifest) or
    bytes, captions, optional ``sample_id``/``source``/``metadata``; other fields go to metadata."""
    if path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise PackError(f"{path}:{number}: not valid JSON ({err})") from None
                yield _manifest_record(row, path.parent, f"{path}:{number}")
        return
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    number = 0
    for batch in parquet.iter_batches(batch_size=256):
        for row in batch.to_pylist():
            number += 1
            yield _manifest_record(row, path.parent, f"{path} row {number}")


def source_records(source: str | Path) -> Iterator[PackRecord]:
    source = Path(source)
    if source.is_dir():
        return folder_records(source)
    if source.is_file() and source.suffix in (".jsonl", ".parquet"):
        return manifest_records(source)
    raise PackError(f"SOURCE {str(source)!r} is neither a folder nor a .jsonl/.parquet manifest")
