"""The report's cheap CPU filters, scored on a thumbnail so thresholds do not depend on resolution.

Each check returns a score; :func:`verdict` turns scores into the first failing reason (or None).
Order matters only for the reason recorded: an all-black image is ``black_white``, not ``flat``;
grey noise is ``noise`` although its colour histogram is also poor.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from .config import FilterConfig

ENTROPY_LEVELS = 16
"""Histogram levels per channel for the RGB entropy (16**3 bins)."""
DOMINANT_SHIFT = 3
"""Colours are compared at 5 bits per channel for the dominant-colour share (JPEG noise tolerance)."""
BLACK_LEVEL, WHITE_LEVEL = 16, 239
"""Near black: every channel below BLACK_LEVEL; near white: every channel above WHITE_LEVEL.
Both bounds lie on edges of the 5-bit bins (multiples of 2**DOMINANT_SHIFT), so the share is
counted from the colour histogram exactly."""
UNIFORM_LINE_SHARE = 0.98
"""A row/column is uniform when this share of its pixels is within tolerance of its median colour."""
BORDER_EDGE_SHARE = 0.5
"""A uniform margin is a border when, just inside it, under half the pixels still have its colour
(a hard edge); a flat illustration background continues past that line and is not a border."""


def neighbour_correlation(grey: np.ndarray) -> float:
    """Autocorrelation at one pixel of a (H, W) float image, horizontally and vertically averaged
    (normalised by the image's own variance; 1.0 for a flat image).

    Scale-free where a gradient energy is not: i.i.d. noise stays near 0 (~0.3 after an antialiased
    downscale) however strong it is and whatever the source size, photographs stay near 1."""
    centred = grey - grey.mean()
    energy = float(np.vdot(centred, centred))
    if energy == 0:
        return 1.0
    horizontal = float(np.vdot(centred[:, 1:], centred[:, :-1])) * grey.shape[1] / (grey.shape[1] - 1)
    vertical = float(np.vdot(centred[1:], centred[:-1])) * grey.shape[0] / (grey.shape[0] - 1)
    return (horizontal + vertical) / (2 * energy)


def colour_histogram(rgb: np.ndarray) -> np.ndarray:
    """(32, 32, 32) counts of a (H, W, 3) uint8 image's colours at 5 bits per channel."""
    q = rgb >> DOMINANT_SHIFT
    # 15-bit codes in uint16: bincount of an int32 array takes ~5x longer on a 256 px thumbnail.
    codes = (q[..., 0].astype(np.uint16) << 10) | (q[..., 1].astype(np.uint16) << 5) | q[..., 2]
    return np.bincount(codes.ravel(), minlength=32768).reshape(32, 32, 32)


def rgb_entropy(histogram: np.ndarray) -> float:
    """Entropy in bits of the joint RGB histogram at 16 levels a channel, from the 5-bit one."""
    counts = histogram
    while len(counts) > ENTROPY_LEVELS:  # merge neighbouring levels on every axis, pairwise
        # (strided adds: ~6x faster than a sum over the axes of a 6-D reshape, same integers)
        counts = counts[:, :, 0::2] + counts[:, :, 1::2]
        counts = counts[:, 0::2] + counts[:, 1::2]
        counts = counts[0::2] + counts[1::2]
    counts = counts[counts > 0].astype(np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def black_white_fraction(histogram: np.ndarray, pixels: int) -> float:
    """Share of the ``pixels`` whose channels are all near black (< BLACK_LEVEL) or all near white
    (> WHITE_LEVEL), read off the 5-bit histogram: both levels fall on its bin edges."""
    low, high = BLACK_LEVEL >> DOMINANT_SHIFT, (WHITE_LEVEL + 1) >> DOMINANT_SHIFT
    dark = histogram[:low, :low, :low].sum()
    light = histogram[high:, high:, high:].sum()
    return float((dark + light) / pixels)


def dominant_fraction(histogram: np.ndarray, pixels: int) -> float:
    """Share of the ``pixels`` with the most common colour (5 bits per channel)."""
    return float(histogram.max() / pixels)


def _median_colour(lines: np.ndarray) -> np.ndarray:
    """(..., 3) int16: the per-channel median of (..., L, 3) uint8 lines, rounded down (np.median's
    value truncated, without its per-call overhead)."""
    ordered = np.sort(lines, axis=-2, kind="stable").astype(np.int16)  # a radix sort for uint8: ~3x faster
    middle = lines.shape[-2] // 2
    if lines.shape[-2] % 2:
        return ordered[..., middle, :]
    return (ordered[..., middle - 1, :] + ordered[..., middle, :]) // 2


def _close_share(lines: np.ndarray, colours: np.ndarray, tolerance: int) -> np.ndarray:
    """(...,) share of each (..., L, 3) line's pixels within ``tolerance`` of its (..., 3) colour
    on every channel."""
    far = np.abs(lines.astype(np.int16) - colours[..., None, :]) > tolerance
    # per-channel planes, not .any(-1): a reduction over a 3-long axis costs more than two ORs
    length = lines.shape[-2]
    return (length - np.count_nonzero(far[..., 0] | far[..., 1] | far[..., 2], axis=-1)) / length


def _margin(lines: np.ndarray, colour: np.ndarray, tolerance: int) -> int:
    """Border width (in lines) of colour ``colour`` at the start of ``lines`` (N, L, 3), 0 when there is none."""
    width = 0
    for line in lines:
        if _close_share(line, colour, tolerance) < UNIFORM_LINE_SHARE:
            break
        width += 1
    if width == 0 or width == len(lines):
        return 0
    return width if _close_share(lines[width], colour, tolerance) < BORDER_EDGE_SHARE else 0


def border_fraction(rgb: np.ndarray, tolerance: int) -> float:
    """Largest share of its side taken by a uniform margin ending at a hard edge (0: no border)."""
    best = 0.0
    for lines in (rgb, rgb.transpose(1, 0, 2)):  # top and bottom rows, then left and right columns
        # Both outer lines at once: a side whose outer line is not uniform has no margin (most images).
        outer = lines[[0, -1]]
        colours = _median_colour(outer)
        for side, colour, share in zip((lines, lines[::-1]), colours, _close_share(outer, colours, tolerance)):
            if share >= UNIFORM_LINE_SHARE:
                best = max(best, _margin(side, colour, tolerance) / len(side))
    return best


def thumbnail(image: Image.Image, side: int) -> Image.Image:
    """An RGB copy with the longer side at most ``side`` (JPEG decodes at reduced size); as pixels,
    ``np.asarray`` of it is (H, W, 3) uint8."""
    # Draft mode decodes a JPEG at 1/2, 1/4 or 1/8 scale, keeping at least the requested size:
    # ask for the thumbnail's own size, not a side x side box (which a 4:3 image's short side misses).
    scale = min(1.0, side / max(image.size))
    image.draft("RGB", (max(1, round(image.width * scale)), max(1, round(image.height * scale))))
    image = image.convert("RGB")
    image.thumbnail((side, side), Image.Resampling.BILINEAR)
    return image


def scores(rgb: np.ndarray, config: FilterConfig) -> dict[str, float]:
    grey = rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    histogram = colour_histogram(rgb)
    pixels = rgb.shape[0] * rgb.shape[1]  # the histogram's sum
    return {
        "black_white": round(black_white_fraction(histogram, pixels), 4),
        "dominant": round(dominant_fraction(histogram, pixels), 4),
        "entropy": round(rgb_entropy(histogram), 4),
        "border": round(border_fraction(rgb, config.uniform_tolerance), 4),
        "neighbour_correlation": round(neighbour_correlation(grey), 4),
    }


def size_verdict(width: int, height: int, config: FilterConfig) -> tuple[str, float] | None:
    """Drop reason from the probed size alone (no decode): ``too_small`` or ``aspect_ratio``."""
    if min(width, height) < config.min_side:
        return "too_small", float(min(width, height))
    aspect = max(width, height) / min(width, height)
    if aspect > config.max_aspect_ratio:
        return "aspect_ratio", aspect
    return None


def verdict(values: dict[str, float], config: FilterConfig) -> tuple[str, float] | None:
    """The first failing filter as ``(reason, score)``, or None when the image passes."""
    checks = (
        ("black_white", values["black_white"] > config.max_black_white_fraction),
        ("flat", values["dominant"] > config.max_dominant_fraction),
        ("noise", values["neighbour_correlation"] < config.min_neighbour_correlation),
        ("low_entropy", values["entropy"] < config.min_entropy),
        ("border", values["border"] >= config.border_min_fraction),
    )
    for reason, failed in checks:
        if failed:
            key = {"flat": "dominant", "low_entropy": "entropy", "noise": "neighbour_correlation"}.get(reason, reason)
            return reason, values[key]
    return None
