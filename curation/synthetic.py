"""A synthetic corpus with known answers, for the tests and the benchmark.

Photograph-like images (smooth random fields, shapes, sensor noise), photographs with natural
(1/f) statistics and film grain, an illustration with a large flat background (must be kept),
exact copies, cropped, resized and recompressed copies, colour variants (same luminance, other
chroma: a perceptual hash alone cannot tell them apart), photographs sharing only a layout, pure
noise, and every kind of bad file the filters must drop. :func:`make_corpus` returns each file's expected fate.
"""

from __future__ import annotations

import io
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

PHOTO_SIZE = (400, 320)


def photo(rng: np.random.Generator, size: tuple[int, int] = PHOTO_SIZE, layout: np.ndarray | None = None) -> Image.Image:
    """A smooth random colour field with a few shapes and mild noise (W, H = size). ``layout``: the
    (6, 8, 3) coarse field to use (photographs that share a layout differ only in their shapes)."""
    w, h = size
    coarse = rng.uniform(0, 255, (6, 8, 3)).astype(np.uint8) if layout is None else layout
    base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float64)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.integers(0, w - 40), rng.integers(0, h - 40)
        box = (int(x0), int(y0), int(x0 + rng.integers(20, 120)), int(y0 + rng.integers(20, 120)))
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    pixels = np.asarray(image, dtype=np.float64) + rng.normal(0, 4, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def layout(rng: np.random.Generator) -> np.ndarray:
    """A coarse (6, 8, 3) colour field for :func:`photo`."""
    return rng.uniform(0, 255, (6, 8, 3)).astype(np.uint8)


def natural(rng: np.random.Generator, size: tuple[int, int] = PHOTO_SIZE, grain: float = 0.0) -> Image.Image:
    """Natural image statistics: a colour field with a 1/f amplitude spectrum (detail at every
    scale, as in photographs of scenes), plus i.i.d. Gaussian film grain of std ``grain``."""
    w, h = size
    radius = np.sqrt(np.fft.fftfreq(h)[:, None] ** 2 + np.fft.fftfreq(w)[None] ** 2)
    radius[0, 0] = 1.0
    field = np.stack([np.real(np.fft.ifft2(np.fft.fft2(rng.normal(size=(h, w))) / radius)) for _ in range(3)], -1)
    field = (field - field.mean()) / field.std() * 50 + rng.uniform(90, 160)
    return Image.fromarray(np.clip(field + rng.normal(0, grain, (h, w, 3)), 0, 255).astype(np.uint8))


def noise(rng: np.random.Generator, kind: str, size: tuple[int, int] = PHOTO_SIZE) -> Image.Image:
    """Pure noise: ``uniform`` RGB, ``gaussian`` RGB (std 40 about a random mean) or ``grey`` Gaussian."""
    w, h = size
    if kind == "uniform":
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    spread = rng.normal(rng.uniform(60, 190), 40, (h, w, 3 if kind == "gaussian" else 1))
    return Image.fromarray(np.clip(np.repeat(spread, 3 // spread.shape[-1], -1), 0, 255).astype(np.uint8))


def copy_of(image: Image.Image, crops: tuple[float, float, float, float] = (0, 0, 0, 0), scale: float = 1.0,
            quality: int = 90) -> bytes:
    """A near copy as JPEG bytes: cropped by ``crops`` (left, top, right, bottom shares of the
    sides), resized by ``scale``, saved at ``quality``."""
    w, h = image.size
    left, top, right, bottom = crops
    image = image.crop((round(left * w), round(top * h), w - round(right * w), h - round(bottom * h)))
    if scale != 1.0:
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.LANCZOS)
    return _jpeg(image, quality)


COPY_KINDS = ("crop<=5%", "resize", "jpeg", "all three", "crop 5-10%", "crop 10-15%", "16:9 of 4:3", "1:1 of 4:3")
"""The near copies :func:`near_copies` makes of a picture, in order."""


def near_copies(rng: np.random.Generator, picture: Image.Image) -> list[tuple[str, bytes]]:
    """One copy of each of :data:`COPY_KINDS` as ``(kind, JPEG bytes)``: cropped by up to 5% a
    side (q95); resized to 50-100% (q95); saved at q60-95; all three; cropped by 5-10% and by
    10-15% on each side, and the 16:9 and 1:1 centre crops of a 4:3 frame (these four also resized
    to 70-100% and saved at q60-95: what the crop windows must find)."""
    crops = lambda low=0.0, high=0.05: tuple(rng.uniform(low, high, 4))  # noqa: E731
    smaller = lambda: float(rng.uniform(0.7, 1.0))  # noqa: E731
    quality = lambda: int(rng.integers(60, 96))  # noqa: E731
    copies = [copy_of(picture, crops(), 1.0, 95),
              copy_of(picture, (0, 0, 0, 0), float(rng.uniform(0.5, 1.0)), 95),
              copy_of(picture, (0, 0, 0, 0), 1.0, quality()),
              copy_of(picture, crops(), float(rng.uniform(0.5, 1.0)), quality()),
              copy_of(picture, crops(0.05, 0.10), smaller(), quality()),
              copy_of(picture, crops(0.10, 0.15), smaller(), quality()),
              copy_of(picture, (0, 0.125, 0, 0.125), smaller(), quality()),
              copy_of(picture, (0.125, 0, 0.125, 0), smaller(), quality())]
    return list(zip(COPY_KINDS, copies))


def illustration(rng: np.random.Generator, size: tuple[int, int] = PHOTO_SIZE) -> Image.Image:
    """A flat background (about 60% of the picture) with gradient-filled shapes well inside it."""
    w, h = size
    pixels = np.empty((h, w, 3), np.uint8)
    pixels[:] = (236, 228, 210)
    ys, xs = np.mgrid[0:h, 0:w]
    for cx, cy, r in ((w * 0.35, h * 0.5, h * 0.3), (w * 0.68, h * 0.45, h * 0.25)):
        inside = (xs - cx) ** 2 + (ys - cy) ** 2 < r ** 2
        colour = rng.uniform(0, 255, 3)
        shade = ((xs - cx + r) / (2 * r))[..., None] * np.array([120, 40, -80]) + colour
        pixels[inside] = np.clip(shade[inside], 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def colour_variant(image: Image.Image) -> Image.Image:
    """Same luminance, chroma mirrored (Cb, Cr -> 255 - Cb, 255 - Cr): other colours, same structure."""
    ycc = np.asarray(image.convert("YCbCr")).copy()
    ycc[..., 1:] = 255 - ycc[..., 1:]
    return Image.fromarray(ycc, "YCbCr").convert("RGB")


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (with a tiny, useless IDAT): must never be decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def make_corpus(folder: str | Path, photos: int = 6, seed: int = 0, bad: bool = True, crops: bool = False) -> dict[str, str]:
    """Write the corpus into ``folder``; returns file name -> expected outcome: ``"kept"``, a drop
    reason, or ``"failed"``. Names sort so that each original is ingested before its copies.
    ``crops``: also a 4:3 photograph (512x384) with copies cropped by 10-15% a side and its 16:9
    and 1:1 centre crops (found through the crop windows)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    expected: dict[str, str] = {}

    def save(name: str, data: bytes, fate: str) -> Path:
        (folder / name).write_bytes(data)
        expected[name] = fate
        return folder / name

    for i in range(photos):
        shared = layout(rng)
        picture = photo(rng, layout=shared)
        original = save(f"p{i:03d}_a.png", _png(picture), "kept")
        if i % 3 == 0:  # exact copy (same bytes)
            shutil.copyfile(original, folder / f"p{i:03d}_b_copy.png")
            expected[f"p{i:03d}_b_copy.png"] = "exact_duplicate"
        if i % 3 == 1:  # cropped by 3-5% on every side, JPEG q60, same scale
            save(f"p{i:03d}_c_cropped.jpg", copy_of(picture, tuple(rng.uniform(0.03, 0.05, 4)), 1.0, 60), "near_duplicate")
        if i % 3 == 2:  # cropped by up to 3% a side, resized to 88% (above min_side), JPEG q75
            save(f"p{i:03d}_d_resized.jpg", copy_of(picture, tuple(rng.uniform(0, 0.03, 4)), 0.88, 75), "near_duplicate")
        if i % 2 == 0:  # colour variant: kept apart
            save(f"p{i:03d}_e_colour.png", _png(colour_variant(picture)), "kept")
        else:  # the same layout, other shapes: kept apart
            save(f"p{i:03d}_f_layout.png", _png(photo(rng, layout=shared)), "kept")
        save(f"g{i:03d}_grainy.jpg", _jpeg(natural(rng, grain=8.0), 90), "kept")  # film grain sigma 8
    save("q_illustration.png", _png(illustration(rng)), "kept")
    if crops:
        picture = photo(rng, (512, 384))
        save("s000_a.png", _png(picture), "kept")
        save("s000_b_crop15.jpg", copy_of(picture, tuple(rng.uniform(0.10, 0.15, 4)), 1.0, 80), "near_duplicate")
        save("s000_c_16x9.jpg", copy_of(picture, (0, 0.125, 0, 0.125), 1.0, 85), "near_duplicate")
        save("s000_d_1x1.jpg", copy_of(picture, (0.125, 0, 0.125, 0), 1.0, 85), "near_duplicate")
    if not bad:
        return expected
    flat = np.full((320, 400, 3), (90, 120, 160), np.uint8)
    flat[150:160, 190:200] = (250, 10, 10)
    save("r_flat.png", _png(Image.fromarray(flat)), "flat")
    framed = np.full((320, 400, 3), 255, np.uint8)
    framed[40:280, 40:360] = np.asarray(photo(rng, (320, 240)))
    save("r_bordered.png", _png(Image.fromarray(framed)), "border")
    letterbox = np.zeros((320, 400, 3), np.uint8)
    letterbox[50:270] = np.asarray(photo(rng, (400, 220)))
    save("r_letterbox.jpg", _jpeg(Image.fromarray(letterbox), 92), "border")
    save("r_noise.png", _png(noise(rng, "uniform")), "noise")
    save("r_noise_gaussian.jpg", _jpeg(noise(rng, "gaussian", (512, 384)), 90), "noise")
    save("r_noise_grey.png", _png(noise(rng, "grey", (640, 480))), "noise")
    save("r_blank.png", _png(Image.new("RGB", (400, 320), (255, 255, 255))), "black_white")
    save("r_tiny.png", _png(photo(rng, (64, 48))), "too_small")
    save("r_1x1.png", _png(Image.new("RGB", (1, 1), (10, 20, 30))), "too_small")
    save("r_strip.png", _png(photo(rng, (1200, 300))), "aspect_ratio")
    save("r_huge_header.png", huge_png_header(100_000, 100_000), "too_large")
    save("r_zero.jpg", b"", "empty_file")
    save("r_text.png", b"this is not an image, just text with an image extension\n", "not_an_image")
    save("r_truncated.jpg", _jpeg(photo(rng), 90)[:4000], "broken")
    (folder / "r_missing.jpg").symlink_to(folder / "does-not-exist.jpg")
    expected["r_missing.jpg"] = "failed"
    return expected


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
