"""Crop-tolerant comparison of two images' grey thumbnails: the near-duplicate verdict.

A perceptual hash moves a lot under a crop (5% per side flips ~30 of the 144 bits, as many as
two photographs that merely share a layout), so the hash only proposes candidates and this module
decides. Each image keeps a ``SIDE x SIDE`` grey thumbnail of its whole frame (aspect ignored). A
crop of up to ``MAX_CROP`` per side, a resize and a recompression map one thumbnail onto the
other by a scale and a shift per axis, ``x_b = s * x_a + t``; the best map per axis is found on
the row and column means (1-D, every map of the grid at once), then the ``CANDIDATES**2``
combinations of the best x and y maps are compared in 2-D (~1 ms a pair). The score is the normalised
correlation of the two aligned thumbnails' *detail* (each minus its local mean): a shared layout
(same coarse light and colour) does not count, only the same edges in the same places.
"""

from __future__ import annotations

import numpy as np

SIDE = 32
"""Thumbnail side in pixels (1 KiB a row as uint8)."""
SAMPLES = 24
"""Points per axis at which the two thumbnails are compared, spread over their overlap."""
MAX_CROP = 0.06
"""Largest crop per side the map grid covers (a copy may also be the larger of the two)."""
SCALE_STEP, SHIFT_STEP = 0.0125, 0.01
"""Grid spacing of the per-axis maps: under half a thumbnail pixel at its edges."""
CANDIDATES = 3
"""Best 1-D maps per axis kept for the 2-D comparison."""
DETAIL_RADIUS = 2
"""The local mean removed before correlating is a (2r+1)^2 box."""


def _interpolation(positions: np.ndarray) -> np.ndarray:
    """(len(positions), SIDE): linear interpolation at ``positions`` in [0, 1] (pixel centres at (i + .5) / SIDE)."""
    x = np.clip(positions * SIDE - 0.5, 0, SIDE - 1)
    low = np.floor(x).astype(int)
    high = np.minimum(low + 1, SIDE - 1)
    weight = x - low
    matrix = np.zeros((len(positions), SIDE))
    rows = np.arange(len(positions))
    np.add.at(matrix, (rows, low), 1 - weight)
    np.add.at(matrix, (rows, high), weight)
    return matrix


def _maps() -> tuple[np.ndarray, np.ndarray]:
    """Resampling matrices of every per-axis map: (M, SAMPLES, SIDE) for image a and for image b.
    The grid holds the identity (scale 1, shift 0) exactly."""
    steps = int(np.ceil((1 / (1 - 2 * MAX_CROP) - 1) / SCALE_STEP))
    shortest_overlap = 1 - 2 * MAX_CROP - 2 * SHIFT_STEP
    a, b = [], []
    for scale in 1 + SCALE_STEP * np.arange(-steps, steps + 1):
        reach = int(np.ceil(MAX_CROP * scale / SHIFT_STEP))
        for shift in SHIFT_STEP * np.arange(-reach, reach + 1):
            low, high = max(0.0, -shift / scale), min(1.0, (1 - shift) / scale)
            if high - low < shortest_overlap:
                continue
            points = np.linspace(low, high, SAMPLES)
            a.append(_interpolation(points))
            b.append(_interpolation(scale * points + shift))
    return np.stack(a), np.stack(b)


def _centred_correlation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Normalised correlation along the last axis (batched)."""
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1) + 1e-9)


def _detail_operator() -> np.ndarray:
    """(SAMPLES, SAMPLES) ``I - box mean`` along one axis (edges replicated); applied on both
    axes it leaves an image's detail, so it is folded into the resampling matrices."""
    r = DETAIL_RADIUS
    box = np.zeros((SAMPLES, SAMPLES))
    for i in range(SAMPLES):
        for j in range(i - r, i + r + 1):
            box[i, min(max(j, 0), SAMPLES - 1)] += 1 / (2 * r + 1)
    return np.eye(SAMPLES) - box


MAPS_A, MAPS_B = _maps()
DETAIL_A, DETAIL_B = _detail_operator() @ MAPS_A, _detail_operator() @ MAPS_B
"""Per-axis map matrices (M, SAMPLES, SIDE), plain (1-D search) and with the detail operator (2-D score)."""


def grey_thumbnail(image) -> bytes:
    """A PIL image's ``SIDE x SIDE`` grey thumbnail (box-filtered, aspect ignored) as bytes."""
    from PIL import Image

    from .hashing import as_mode

    return as_mode(image, "L").resize((SIDE, SIDE), Image.Resampling.BOX).tobytes()


def _best_maps(profile_a: np.ndarray, profile_b: np.ndarray) -> np.ndarray:
    """Indices of the CANDIDATES maps under which two (SIDE,) mean profiles agree best."""
    count = len(MAPS_A)
    a = (MAPS_A.reshape(-1, SIDE) @ profile_a).reshape(count, SAMPLES)
    b = (MAPS_B.reshape(-1, SIDE) @ profile_b).reshape(count, SAMPLES)
    return np.argpartition(-_centred_correlation(a, b), CANDIDATES)[:CANDIDATES]


def similarity(a: bytes, b: bytes) -> float:
    """Best detail correlation (-1..1) of two thumbnails over crops up to MAX_CROP per side.

    Copies (crops <= 5% a side, resizes, JPEG q >= 60) score above ~0.95, photographs sharing
    only a layout below ~0.8, unrelated images below ~0.4 (tests/test_curation_quality.py)."""
    ta = np.frombuffer(a, np.uint8).reshape(SIDE, SIDE).astype(np.float64)
    tb = np.frombuffer(b, np.uint8).reshape(SIDE, SIDE).astype(np.float64)
    xs = _best_maps(ta.mean(0), tb.mean(0))
    ys = _best_maps(ta.mean(1), tb.mean(1))
    # (C, C, SAMPLES, SAMPLES): the detail of every pair of kept maps (y maps first, x maps second).
    detail_a = (DETAIL_A[ys] @ ta)[:, None] @ DETAIL_A[xs].transpose(0, 2, 1)[None]
    detail_b = (DETAIL_B[ys] @ tb)[:, None] @ DETAIL_B[xs].transpose(0, 2, 1)[None]
    shape = detail_a.shape[:2] + (-1,)
    return float(_centred_correlation(detail_a.reshape(shape), detail_b.reshape(shape)).max())
