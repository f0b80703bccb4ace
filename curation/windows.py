"""Crop windows: the second near-duplicate candidate source, for copies cropped by 5-15% a side
and aspect-changing centre crops (16:9 or 1:1 out of 4:3).

A pHash sees the whole frame, so a crop of 10% a side moves it ~50 of 144 bits (beyond the
candidate radius) and a 16:9 centre crop of a 4:3 image, stretched to the hash's square, ~55.
Each image therefore also stores the fingerprints of a few centred *windows* of itself
(:data:`WINDOWS`): a copy cropped to about a window's share of each side has a full-frame hash
within the radius of that window's hash (measured: <= 38 bits for crops of 10-15% a side, <= 2
for the exact 16:9 and 1:1 centre crops). A pair is a candidate when one image's full hash is
close to one of the other's window hashes, found from either side: the later image probes the
window index with its full hash (it is the crop) and the full-frame index with its window hashes
(it is the original). The window acts as a virtual image: its colour hash is stored, its
thumbnail is cut from the stored full-frame one (:func:`window_thumbnail`), and the same colour
and alignment rules decide.

Why windows and not the embedding neighbours the ``embed`` job computes: embed runs after dedup
(on kept rows) and only with a real encoder (the tests' tiny random one gives no neighbours worth
the name), so a crop would stay kept until a late pass, and an embedding neighbour search in the
warehouse needs a vector index that ``pgserver``'s pgvector 0.6.2 builds at a few thousand rows a
second. Window hashes are computed with the other fingerprints at filter time (~0.2 ms a row on
the analysis thumbnail) and probed through the same multi-index keys as the full hash, so the
cost per image stays bounded by the probes, not the table.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image

from .alignment import SIDE
from .hash_index import LEGACY_WEAK_BITS, SUBSTRINGS, WEAK_BITS, weak_bits
from .hashing import colour_hash, perceptual_hash_margins

WINDOWS = ((0.85, 0.85), (0.75, 0.75), (1.0, 0.75), (0.75, 1.0))
"""Centred windows as (share of the width, share of the height). 0.85 covers crops of ~5-10% a
side, 0.75 crops of ~10-15% (a residual of under ~6% a side, what the full-frame hash and the
alignment tolerate), (1, 0.75) the 16:9 centre crop of a 4:3 frame and (0.75, 1) its 1:1 one."""


@functools.lru_cache(maxsize=4)
def record_layout(hash_size: int, colour_grid: int) -> tuple[int, int, int]:
    """Bytes of one window's (pHash, weak bits, colour hash) record."""
    return hash_size ** 2 // 8 + (hash_size ** 2 % 8 > 0), SUBSTRINGS * WEAK_BITS, 2 * colour_grid ** 2


def _box(size: tuple[int, int], window: tuple[float, float]) -> tuple[float, float, float, float]:
    w, h = size
    rx, ry = window
    return w * (1 - rx) / 2, h * (1 - ry) / 2, w * (1 + rx) / 2, h * (1 + ry) / 2


def window_fingerprints(grey: Image.Image, rgb: Image.Image, hash_size: int, colour_grid: int) -> bytes:
    """Of each window of :data:`WINDOWS`: the pHashes, then the weak bits their probes flip, then
    the colour hashes (len(WINDOWS) * sum(record_layout(...)) bytes; the hashes first, so a scan
    reads ``substring(crop_windows for len(WINDOWS) * hash bytes)``). ``grey`` and ``rgb``: the
    analysis thumbnail (the same image, grey and RGB)."""
    hashes, weak, colours = [], [], []
    for window in WINDOWS:
        box = _box(grey.size, window)  # each fingerprint resamples the window straight from the thumbnail
        phash, margins = perceptual_hash_margins(grey, hash_size, box)
        hashes.append(phash)
        weak.append(weak_bits(margins, hash_size))
        colours.append(colour_hash(rgb, colour_grid, box))
    return b"".join(hashes + weak + colours)


def unpack(data: bytes, hash_size: int, colour_grid: int) -> list[tuple[bytes, bytes, bytes]]:
    """``(phash, weak, colour)`` per window, from :func:`window_fingerprints`' bytes (or schema 4-5's,
    whose weak bits are 6 a key: curation.hash_index.ranked_weak reads them)."""
    sizes = record_layout(hash_size, colour_grid)
    count = len(WINDOWS)
    legacy = (sizes[0], SUBSTRINGS * LEGACY_WEAK_BITS, sizes[2])
    if len(data) == sum(legacy) * count:
        sizes = legacy
    elif len(data) != sum(sizes) * count:
        raise ValueError(f"crop windows of {len(data)} bytes; expected {sum(sizes) * count}")
    starts = (0, sizes[0] * count, (sizes[0] + sizes[1]) * count)
    return [tuple(data[start + j * size:start + (j + 1) * size] for start, size in zip(starts, sizes))
            for j in range(count)]


def window_thumbnail(thumbnail: bytes, window: int) -> bytes:
    """The ``SIDE x SIDE`` grey alignment thumbnail of window ``window`` (an index of
    :data:`WINDOWS`), cut from a full-frame one and resampled back to ``SIDE``."""
    image = Image.frombytes("L", (SIDE, SIDE), thumbnail)
    return image.resize((SIDE, SIDE), Image.Resampling.BILINEAR, box=_box((SIDE, SIDE), WINDOWS[window])).tobytes()


def window_hashes(data: list[bytes], hash_size: int) -> np.ndarray:
    """(N * len(WINDOWS), hash bytes) uint8: the window hashes of N rows (row 0's windows first),
    from their :func:`window_fingerprints` or its leading hash bytes."""
    size = record_layout(hash_size, 1)[0]
    head = b"".join(d[:size * len(WINDOWS)] for d in data)
    return np.frombuffer(head, np.uint8).reshape(len(data) * len(WINDOWS), size)
