"""Synthetic edit pairs for the tiny edit-LoRA example and its test: a grey rectangle on a flat
background (the reference) -> the same rectangle red (the target), instruction "make it red".

    python -m finetune.data.synthetic_pairs DIR [--count N] [--offset K] [--size PX]

writes ``DIR/targets/pair_NNN.png`` + ``pair_NNN.txt`` and ``DIR/references/pair_NNN.png`` (the
folder layout of :mod:`finetune.data.pairs`). The pairs are drawn from a fixed shuffled list of
every (background, rectangle) combination, so ``--offset`` gives a disjoint held-out set.
Rectangles sit on the 16-pixel token grid (2 or 3 tokens a side on a 4 x 4 grid at 64 px), so
every 8 x 8 latent cell is one flat colour.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
from PIL import Image

INSTRUCTION = "make it red"
GREY = (0.5, 0.5, 0.5)
RED = (0.85, 0.1, 0.1)
BACKGROUNDS = ((0.95, 0.95, 0.9), (0.1, 0.15, 0.4), (0.2, 0.45, 0.2))
GRID = 4  # tokens per side
# Rectangles of 2 or 3 tokens a side: the tiny model's attention is too blunt to copy a single
# token's position from the reference (its qk-norm bounds the logits; see tests/test_finetune_pairs.py).
MIN_SIDE = 2
_ORDER_SEED = 0


def layouts() -> list[tuple[tuple[float, float, float], tuple[int, int, int, int]]]:
    """Every (background colour, rectangle (top, left, height, width) in tokens), in a fixed shuffled order."""
    rects = [(top, left, h, w) for h in range(MIN_SIDE, GRID) for w in range(MIN_SIDE, GRID)
             for top in range(GRID - h + 1) for left in range(GRID - w + 1)]
    combos = [(bg, rect) for bg in BACKGROUNDS for rect in rects]
    random.Random(_ORDER_SEED).shuffle(combos)
    return combos


def pair_images(background, rect, size: int) -> tuple[Image.Image, Image.Image, np.ndarray]:
    """(reference, target, shape mask (size, size) bool) of one layout at ``size`` px."""
    token = size // GRID
    top, left, h, w = rect
    mask = np.zeros((size, size), dtype=bool)
    mask[top * token:(top + h) * token, left * token:(left + w) * token] = True
    images = []
    for colour in (GREY, RED):
        pixels = np.where(mask[..., None], np.array(colour), np.array(background))
        images.append(Image.fromarray((pixels * 255).round().astype("uint8")))
    return images[0], images[1], mask


def make_edit_pairs(folder: str | Path, count: int = 24, offset: int = 0, size: int = 64) -> Path:
    """Write ``count`` pairs (layouts ``offset`` ... ``offset + count - 1``) into ``folder``. Idempotent."""
    combos = layouts()
    if size % GRID or size < 16 * GRID:
        raise ValueError(f"size must be a multiple of {GRID} and at least {16 * GRID}, got {size}")
    if not 0 <= offset or offset + count > len(combos):
        raise ValueError(f"offset + count must be at most {len(combos)} (every layout), got {offset} + {count}")
    folder = Path(folder)
    (folder / "targets").mkdir(parents=True, exist_ok=True)
    (folder / "references").mkdir(parents=True, exist_ok=True)
    for index in range(offset, offset + count):
        reference, target, _ = pair_images(*combos[index], size)
        name = f"pair_{index:03d}"
        if not (folder / "targets" / f"{name}.png").exists():
            reference.save(folder / "references" / f"{name}.png")
            (folder / "targets" / f"{name}.txt").write_text(INSTRUCTION, encoding="utf-8")
            target.save(folder / "targets" / f"{name}.png")
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m finetune.data.synthetic_pairs", description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--offset", type=int, default=0, help="first layout (a disjoint held-out set starts after the training count)")
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args(argv)
    print(make_edit_pairs(args.folder, args.count, args.offset, args.size))


if __name__ == "__main__":
    main()
