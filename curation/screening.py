"""The screening jobs ``probe`` and ``filter``: per-image work on claimed rows, one outcome per row.

``probe`` reads the file once (md5, size), checks the header (format, width, height: a header
beyond the size limits is dropped without decoding) and decodes it once, straight to the
analysis thumbnail (JPEG decodes at reduced scale in draft mode, which still reads every byte, so
truncated or corrupt data fails here). ``filter`` scores that thumbnail with the CPU filters and,
for images that pass, computes what ``dedup`` compares. When one worker serves both, probe hands
its batch to filter with the decoded thumbnails (:class:`DecodedImages`): one read and one decode
a row. File problems that may be transient (missing, unreadable) are retryable errors; content
problems (empty, not an image, truncated, absurd size) are final drops.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .alignment import grey_thumbnail
from .config import CurationConfig
from .filters import scores, size_verdict, thumbnail, verdict
from .hash_index import KEY_COLUMNS, bit_text, row_keys, weak_bits
from .hashing import colour_hash, perceptual_hash_margins
from .warehouse import Outcome
from .windows import window_fingerprints

FILE_SCHEME = "file://"


def local_path(uri: str) -> Path:
    """The local file of a ``file://`` URI or plain path (other schemes are not fetched)."""
    if uri.startswith(FILE_SCHEME):
        return Path(uri[len(FILE_SCHEME):])
    if "://" in uri:
        raise OSError(f"{uri}: only local paths and file:// URIs can be read")
    return Path(uri)


def _open(data: bytes) -> Image.Image:
    # Our own size limit (ProbeConfig) replaces PIL's decompression-bomb check, so a huge header
    # becomes a recorded drop instead of an exception or a warning (with no limit PIL neither
    # raises nor warns).
    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        return Image.open(io.BytesIO(data))
    finally:
        Image.MAX_IMAGE_PIXELS = limit


class DecodedImages:
    """Analysis thumbnails (RGB images, :func:`~curation.filters.thumbnail`) that probe decoded, by
    row id, for the filter job of the same worker; emptied as filter takes them (one batch's worth
    at a time)."""

    def __init__(self):
        self.thumbnails: dict[int, Image.Image] = {}

    def keep(self, row_id: int, image: Image.Image) -> None:
        self.thumbnails[row_id] = image

    def take(self, row_id: int) -> Image.Image | None:
        return self.thumbnails.pop(row_id, None)

    def clear(self) -> None:
        self.thumbnails.clear()


def probe_row(row: dict, config: CurationConfig) -> tuple[Outcome, Image.Image | None]:
    """The probe outcome and, when the image decoded, its analysis thumbnail."""
    try:
        data = local_path(row["uri"]).read_bytes()
    except OSError as err:
        return Outcome(row["id"], error=f"{type(err).__name__}: {err}"), None
    values = {"md5": hashlib.md5(data).hexdigest(), "size_bytes": len(data)}
    if not data:
        return Outcome(row["id"], values, drop="empty_file", score=0.0, detail="zero-byte file"), None
    try:
        image = _open(data)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        return Outcome(row["id"], values, drop="not_an_image", detail=f"{type(err).__name__}: {err}"), None
    values.update(format=image.format, width=image.width, height=image.height)
    pixels = image.width * image.height
    if pixels > config.probe.max_pixels or max(image.size) > config.probe.max_side:
        return Outcome(row["id"], values, drop="too_large", score=float(max(image.size)),
                       detail=f"header declares {image.width}x{image.height}; not decoded"), None
    try:
        small = thumbnail(image, config.filter.analysis_side)  # the one decode: every byte is read
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        return Outcome(row["id"], values, drop="broken", detail=f"{type(err).__name__}: {err}"), None
    return Outcome(row["id"], values), small


def filter_outcome(row: dict, small: Image.Image, config: CurationConfig) -> Outcome:
    """Scores of an analysis thumbnail (RGB); for images that pass, the hashes and the alignment thumbnail."""
    values = scores(np.asarray(small), config.filter)
    failed = verdict(values, config.filter)
    if failed is not None:
        return Outcome(row["id"], {"filter_scores": values}, drop=failed[0], score=failed[1])
    grey = small.convert("L")  # both grey fingerprints start from it: one conversion
    phash, margins = perceptual_hash_margins(grey, config.dedup.hash_size)
    # The index keys are written with the hash: a row is in the near-duplicate index (unplaced)
    # before any worker deduplicates it, so of two copies deduplicated at once one sees the other.
    index = dict(zip(KEY_COLUMNS, row_keys(phash, config.dedup.hash_size)), phash_bits=bit_text(phash))
    return Outcome(row["id"], {"filter_scores": values, "phash": phash, **index,
                               "phash_weak": weak_bits(margins, config.dedup.hash_size),
                               "colour_hash": colour_hash(small, config.dedup.colour_grid),
                               "thumbnail": grey_thumbnail(grey),
                               "crop_windows": window_fingerprints(grey, small, config.dedup.hash_size,
                                                                   config.dedup.colour_grid)})


def filter_row(row: dict, config: CurationConfig, decoded: DecodedImages | None = None) -> Outcome:
    size = size_verdict(row["width"], row["height"], config.filter)
    if size is not None:
        return Outcome(row["id"], drop=size[0], score=size[1])
    small = decoded.take(row["id"]) if decoded is not None else None
    if small is None:  # not probed by this worker: read and decode here
        try:
            with _open(local_path(row["uri"]).read_bytes()) as image:
                small = thumbnail(image, config.filter.analysis_side)
        except OSError as err:
            return Outcome(row["id"], error=f"{type(err).__name__}: {err}")
    return filter_outcome(row, small, config)
