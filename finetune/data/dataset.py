"""Finding training samples: an image folder with same-name ``.txt`` captions, or a JSONL/Parquet
manifest. Broken images and missing captions are skipped and counted, never fatal; an empty
result is an error raised before any model is loaded."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}


class DatasetError(ValueError):
    """The dataset cannot be trained on (reported before training starts)."""


@dataclass(frozen=True)
class Sample:
    image_path: Path
    caption: str
    width: int
    height: int
    crop: tuple[int, int, int, int] | None = None
    """Optional (left, top, right, bottom) applied before bucketing."""
    style_id: str | None = None
    """The style group (a subfolder of the dataset folder, or a manifest's ``style_id``); style-reference
    training takes a sample's references from the other images of its group."""
    references: tuple[Path, ...] = ()
    """Paired training (``data.references``): the reference images of this target, in order."""
    mask: Path | None = None
    """Its loss mask (:mod:`finetune.data.masks`); None trains the whole image."""
    dataset: int = 0
    """Index of its entry in ``data.datasets`` (0 for a single ``data.path``)."""

    @property
    def size(self) -> tuple[int, int]:
        if self.crop is not None:
            return self.crop[2] - self.crop[0], self.crop[3] - self.crop[1]
        return self.width, self.height


@dataclass
class DatasetScan:
    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> paths, e.g. ``{"broken image": [...], "missing caption": [...]}``."""

    def skip(self, reason: str, path: Path | str) -> None:
        self.skipped.setdefault(reason, []).append(str(path))

    def summary(self) -> str:
        parts = [f"{len(self.samples)} samples"]
        parts += [f"{len(paths)} skipped ({reason})" for reason, paths in sorted(self.skipped.items())]
        return ", ".join(parts)


def probe_image(path: Path, scan: DatasetScan) -> tuple[int, int] | None:
    """Image size, or None (and a counted skip) when the file cannot be decoded."""
    try:
        with Image.open(path) as image:
            image.load()  # decode fully: truncated files pass `verify` but fail later in training
            return image.size
    except Exception as err:  # PIL raises many types for bad files; any of them means "skip"
        logger.warning("skipping broken image %s: %s", path, err)
        scan.skip("broken image", path)
        return None


def scan_folder(folder: Path, caption_extension: str = ".txt") -> DatasetScan:
    scan = DatasetScan()
    # NAME.mask.png is the loss mask of NAME.png (finetune.data.masks), never a sample itself.
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and not p.stem.endswith(".mask")):
        caption_path = path.with_suffix(caption_extension)
        if not caption_path.is_file():
            scan.skip("missing caption", path)
            continue
        size = probe_image(path, scan)
        if size is not None:
            caption = caption_path.read_text(encoding="utf-8").strip()
            parts = path.relative_to(folder).parts
            scan.samples.append(Sample(path, caption, *size, style_id=parts[0] if len(parts) > 1 else None))
    return scan


def manifest_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{path}:{number}: not valid JSON ({err})") from None
        return rows
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow (pip install pyarrow), or use a .jsonl manifest") from None
    return pq.read_table(path).to_pylist()


def scan_manifest(path: Path) -> DatasetScan:
    """Rows need ``path`` (relative to the manifest) and ``caption``; ``width``/``height`` and
    ``crop`` ([left, top, right, bottom]), ``style_id`` and ``references`` (paths relative to the
    manifest, paired training) are optional."""
    scan = DatasetScan()
    for row in manifest_rows(path):
        image_path = row.get("path") or row.get("image")
        if not image_path:
            scan.skip("row without path", json.dumps(row)[:80])
            continue
        image_path = (path.parent / image_path).resolve()
        caption = row.get("caption", row.get("text"))
        if caption is None:
            scan.skip("missing caption", image_path)
            continue
        size = probe_image(image_path, scan) if image_path.is_file() else None
        if not image_path.is_file():
            scan.skip("missing image", image_path)
        if size is None:
            continue
        crop = tuple(int(v) for v in row["crop"]) if row.get("crop") is not None else None
        style_id = None if row.get("style_id") is None else str(row["style_id"])
        references = row.get("references") or ()
        references = tuple((path.parent / r).resolve() for r in ([references] if isinstance(references, str) else references))
        scan.samples.append(Sample(image_path, str(caption).strip(), *size, crop=crop, style_id=style_id, references=references))
    return scan


def scan_dataset(path: str | Path, key: str = "data.path") -> DatasetScan:
    """``key``: the config key that named ``path``, for the error messages."""
    path = Path(path)
    if path.is_dir():
        scan = scan_folder(path)
    elif path.suffix in (".jsonl", ".parquet") and path.is_file():
        scan = scan_manifest(path)
    else:
        raise DatasetError(f"{key} {str(path)!r} is neither a folder nor a .jsonl/.parquet manifest")
    if not scan.samples:
        raise DatasetError(f"no usable samples in {path} ({key}; {scan.summary()}); need images with same-name .txt captions")
    return scan


# ----------------------------------------------------------------------------------------------
# A synthetic dataset for smoke tests and the tiny example


# Captions of different lengths and words, so even a random text encoder tells them apart.
SYNTHETIC_WORDS = ("red", "a deep blue ocean seen from far above", "green grass, 1998",
                   "sunflower yellow paint on wood and glass", "purple", "an orange split in two halves at noon",
                   "white tiles", "cyan sky over a quiet dark triangle")


def make_synthetic_dataset(folder: str | Path, num_prompts: int = 4, images_per_prompt: int = 1, size: int = 64) -> Path:
    """Write ``num_prompts`` distinct, deterministic flat-colour images with captions into ``folder``.

    Each caption maps to one image (repeated ``images_per_prompt`` times). Idempotent: existing
    files are kept.
    """
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # One flat colour per caption: distinct at every scale (pixels, latents, 2x2 tokens), so a
    # model that learned the set must produce a specific image per caption. Spatial patterns are
    # avoided on purpose: a tiny model cannot place them in a short run.
    palette = np.array([[0.9, 0.1, 0.1], [0.1, 0.2, 0.9], [0.1, 0.8, 0.2], [0.95, 0.85, 0.1],
                        [0.6, 0.1, 0.8], [1.0, 0.5, 0.0], [0.9, 0.9, 0.9], [0.1, 0.8, 0.8]])
    for p in range(num_prompts):
        colour = palette[p % len(palette)] * (1.0 - 0.5 * (p // len(palette) % 2))
        image = Image.fromarray(np.broadcast_to(colour * 255, (size, size, 3)).astype("uint8"))
        caption = SYNTHETIC_WORDS[p % len(SYNTHETIC_WORDS)] + (f" {p // len(SYNTHETIC_WORDS)}" if p >= len(SYNTHETIC_WORDS) else "")
        for i in range(images_per_prompt):
            stem = folder / f"sample_{p:03d}_{i:02d}"
            if not stem.with_suffix(".png").exists():
                image.save(stem.with_suffix(".png"))
                stem.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return folder
