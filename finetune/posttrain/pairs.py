"""Preference pairs for DPO: a JSONL/Parquet manifest of ``prompt``, ``chosen``, ``rejected``.

A pair whose images are missing or cannot be decoded is skipped and counted (never fatal); an
empty result stops the run before any model loads. Each image becomes a training
:class:`~finetune.data.Sample` captioned with the pair's prompt, so the usual latent/text cache
encodes them: samples ``2 i`` and ``2 i + 1`` are pair ``i``'s chosen and rejected images.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..data.dataset import SYNTHETIC_WORDS, DatasetError, DatasetScan, Sample, manifest_rows, probe_image

logger = logging.getLogger("finetune")

PAIR_EXTENSIONS = (".jsonl", ".parquet")


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: Sample
    rejected: Sample


def scan_pairs(path: str | Path) -> tuple[list[Pair], DatasetScan]:
    """Usable pairs in manifest order, and a scan whose ``skipped`` counts the rest by reason."""
    path = Path(path)
    if path.suffix not in PAIR_EXTENSIONS or not path.is_file():
        raise DatasetError(f"dpo.data {str(path)!r} is not a .jsonl/.parquet file of prompt, chosen, rejected")
    scan = DatasetScan()
    pairs = []
    for number, row in enumerate(manifest_rows(path), 1):
        missing = [key for key in ("prompt", "chosen", "rejected") if row.get(key) in (None, "")]
        if missing:
            scan.skip(f"row without {missing[0]}", f"{path}:{number}")
            continue
        images = []
        for key in ("chosen", "rejected"):
            image_path = (path.parent / row[key]).resolve()
            if not image_path.is_file():
                scan.skip("missing image", image_path)
                break
            size = probe_image(image_path, scan)
            if size is None:
                break
            images.append(Sample(image_path, str(row["prompt"]).strip(), *size))
        if len(images) == 2:
            pairs.append(Pair(str(row["prompt"]).strip(), *images))
    scan.samples = [s for p in pairs for s in (p.chosen, p.rejected)]
    if scan.skipped:
        logger.warning("preference pairs %s: %d pairs, %s", path, len(pairs), scan.summary())
    if not pairs:
        raise DatasetError(f"no usable preference pairs in {path} ({scan.summary()})")
    return pairs, scan


# A warm colour preferred over a cool one: a preference that holds whatever the prompt, so held-out
# pairs measure whether it was learnt rather than memorised.
_WARM = ((0.9, 0.2, 0.1), (0.95, 0.6, 0.1), (0.85, 0.35, 0.3))
_COOL = ((0.1, 0.3, 0.9), (0.1, 0.7, 0.8), (0.3, 0.2, 0.8))


def make_synthetic_pairs(manifest: str | Path, num_pairs: int = 12, size: int = 64) -> Path:
    """Write ``num_pairs`` flat-colour pairs (chosen warm, rejected cool) beside ``manifest`` (a
    ``.jsonl`` path) and the manifest itself; returns it. Idempotent: an existing manifest is kept."""
    import numpy as np
    from PIL import Image

    manifest = Path(manifest)
    folder = manifest.parent
    folder.mkdir(parents=True, exist_ok=True)
    if manifest.exists():
        return manifest
    rows = []
    for i in range(num_pairs):
        shade = 1.0 - 0.3 * (i // len(_WARM) % 3) / 2
        for kind, palette in (("chosen", _WARM), ("rejected", _COOL)):
            colour = np.array(palette[i % len(palette)]) * shade
            Image.fromarray(np.broadcast_to(colour * 255, (size, size, 3)).astype("uint8")).save(folder / f"{kind}_{i:03d}.png")
        prompt = SYNTHETIC_WORDS[i % len(SYNTHETIC_WORDS)] + (f" {i // len(SYNTHETIC_WORDS)}" if i >= len(SYNTHETIC_WORDS) else "")
        rows.append({"prompt": prompt, "chosen": f"chosen_{i:03d}.png", "rejected": f"rejected_{i:03d}.png"})
    from krea2_diffusers.files import atomic_write

    with atomic_write(manifest, "w") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    return manifest
