"""A synthetic image set for the tiny pretraining example and the tests: flat-colour images of
several aspect ratios with long/medium/short captions in a JSONL manifest.

    python -m finetune.packs.synthetic DIR [--count N]   # writes DIR/*.png and DIR/manifest.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

# (width, height): square, landscape and portrait, all large enough for 128 px buckets.
SIZES = ((160, 160), (224, 128), (128, 224), (192, 144))
COLOURS = {"red": (230, 30, 30), "blue": (30, 50, 230), "green": (30, 200, 50), "yellow": (240, 215, 30),
           "purple": (150, 30, 200), "orange": (250, 130, 0), "white": (230, 230, 230), "cyan": (30, 200, 200)}
MANIFEST = "manifest.jsonl"


def make_synthetic_set(folder: str | Path, count: int = 32) -> Path:
    """Write ``count`` images and ``manifest.jsonl`` into ``folder``; returns the manifest path.

    Image i is a flat colour (i mod 8) over a darker lower half (i // 8 mod 2 flips it to the upper
    half), so the captions describe something a tiny model can learn."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    lines = []
    for i in range(count):
        name = names[i % len(names)]
        width, height = SIZES[i % len(SIZES)]
        pixels = np.empty((height, width, 3), dtype=np.uint8)
        pixels[:] = COLOURS[name]
        half = "lower" if (i // len(names)) % 2 == 0 else "upper"
        rows = slice(height // 2, None) if half == "lower" else slice(None, height // 2)
        pixels[rows] = pixels[rows] // 3
        path = folder / f"synthetic_{i:04d}.png"
        Image.fromarray(pixels).save(path)
        lines.append(json.dumps({
            "path": path.name, "sample_id": f"synthetic_{i:04d}",
            "caption_long": f"a flat {name} picture whose {half} half is in deep shadow, {width}x{height}",
            "caption_medium": f"{name}, dark {half} half", "caption_short": name,
        }))
    manifest = folder / MANIFEST
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m finetune.packs.synthetic", description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--count", type=int, default=32)
    args = parser.parse_args(argv)
    print(make_synthetic_set(args.folder, args.count))


if __name__ == "__main__":
    main()
