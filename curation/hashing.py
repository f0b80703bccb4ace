"""Image fingerprints for near-duplicate search: a perceptual (DCT) hash and a colour hash.

The perceptual hash sees only luminance structure, so an 8x8 (or 12x12) pHash alone merges
images that differ only in colour; the report's fix, used here, is to also require a close colour
hash (the mean chroma of a coarse grid) before two images count as duplicates.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image

PHASH_OVERSAMPLE = 4
"""The DCT runs on a (4 * hash_size)^2 grey thumbnail: low frequencies without aliasing."""


@functools.lru_cache(maxsize=8)
def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix, (n, n): row k is the k-th cosine basis vector."""
    k = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    matrix = np.cos(np.pi * (2 * x + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    matrix[0] /= np.sqrt(2.0)
    return matrix


def as_mode(image: Image.Image, mode: str) -> Image.Image:
    """``image`` in ``mode``: itself when it already is (``convert`` would copy it)."""
    return image if image.mode == mode else image.convert(mode)


def perceptual_hash(image: Image.Image, hash_size: int = 12) -> bytes:
    """pHash: the hash_size x hash_size lowest DCT frequencies of a grey thumbnail, each bit set
    when the coefficient exceeds their median (the DC term excluded from the median).

    Returns hash_size**2 bits packed into bytes (18 bytes for 12x12).
    """
    return perceptual_hash_margins(image, hash_size)[0]


def perceptual_hash_margins(image: Image.Image, hash_size: int = 12,
                            box: tuple[float, float, float, float] | None = None) -> tuple[bytes, np.ndarray]:
    """The pHash and, per bit, how far its coefficient lies from the median ((hash_size**2,)
    float, row-major like the bits): bits with small margins are the ones a copy flips. ``box``:
    of the region (left, top, right, bottom in pixels) instead of the whole image."""
    side = hash_size * PHASH_OVERSAMPLE
    grey = np.asarray(as_mode(image, "L").resize((side, side), Image.Resampling.BILINEAR, box=box), dtype=np.float64)
    dct = _dct_matrix(side)
    low = (dct @ grey @ dct.T)[:hash_size, :hash_size].ravel()
    centred = low - _median(low[1:])
    return np.packbits(centred > 0).tobytes(), np.abs(centred)


def _median(values: np.ndarray) -> float:
    """np.median of a 1-D array (the middle value, or the mean of the two middle ones) without
    its per-call overhead, which was a tenth of the filter job's hashing time."""
    middle = len(values) // 2
    if len(values) % 2:
        return np.partition(values, middle)[middle]
    pair = np.partition(values, (middle - 1, middle))[middle - 1:middle + 1]
    return (pair[0] + pair[1]) / 2


def colour_hash(image: Image.Image, grid: int = 4, box: tuple[float, float, float, float] | None = None) -> bytes:
    """Mean chroma (Cb, Cr of YCbCr, 0-255) of each cell of a grid x grid split: 2 * grid**2 bytes.
    ``box``: of the region (left, top, right, bottom in pixels) instead of the whole image."""
    cells = as_mode(image, "RGB").resize((grid, grid), Image.Resampling.BOX, box=box).convert("YCbCr")
    return np.asarray(cells, dtype=np.uint8)[..., 1:].tobytes()


def hash_int(digest: bytes) -> int:
    """A packed hash as one Python int, so Hamming distance is ``(a ^ b).bit_count()``."""
    return int.from_bytes(digest, "big")


def colour_distance(a: bytes, b: bytes) -> float:
    """Mean absolute chroma difference of two colour hashes (0-255)."""
    return float(np.abs(np.frombuffer(a, np.uint8).astype(np.int16) - np.frombuffer(b, np.uint8)).mean())
