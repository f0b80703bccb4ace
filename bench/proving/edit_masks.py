#!/usr/bin/env python
"""How much of the edit gate's IoU ratio is the ink mask's definition? (issue 39)

    python bench/proving/edit_masks.py [--run DIR [--summary JSON]] [--seed S] [--json OUT]

The edit stage reads an output's shape through an ink mask: pixels at least
:data:`proving.digits.INK_DARKNESS` (0.2) darker than paper in *luminance* (:func:`proving.edit.ink_mask`).
Two things about that mask decide the ratio as much as the edit does:

- it depends on the ink's colour: full red ink (220, 20, 20) is only 0.66 dark in luminance, black 1.0,
  so a red stroke's mask is thinner than the same black stroke's (a perfect edit overlaps its own source
  at IoU 0.89, not 1);
- its threshold: the scans are 8x8, upscaled bicubically to 64 px, so strokes have soft edges, and a low
  threshold takes in the halo where two scans of one digit overlap.

This prints the ratio (IoU with the source / IoU with another scan of the same digit, as the stage
computes it) under two masks at thresholds 0.2-0.7: ``luminance`` (the stage's) and ``coverage``,
``1 - min(R, G, B) / 255``, which reads ink of any dark-channelled colour alike (full red ink 0.92,
black 1.0), for the perfect edit (each held-out source rendered in red ink: the ceiling) and, with
``--run``, for the edit LoRA's own outputs (``DIR/samples/edit``, next to ``DIR/samples/edit_source``).
The ``luminance`` row at 0.2 is the stage's figure (checked against the run's JSON). Without ``--run``
it needs no model: the ceiling of seeds 0, 1 and 2 (or ``--seed``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from proving.edit import iou, luminance_darkness  # noqa: E402

THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def coverage(images: np.ndarray) -> np.ndarray:
    """float (N, H, W) in [0, 1]: darkness of the darkest channel, i.e. the share of a pixel an ink with a
    dark channel covers (black 1.0, the bench's red 0.92), whatever the ink's colour."""
    return 1 - images.astype(np.float32).min(axis=-1) / 255


MEASURES = {"luminance": luminance_darkness, "coverage": coverage}
"""Per mask, its darkness map; ``luminance`` is the stage's own (:func:`proving.edit.ink_mask`)."""


def ratios(outputs: np.ndarray, sources: np.ndarray, others: np.ndarray, measure, threshold: float) -> dict:
    """{"iou_source", "iou_other", "iou_ratio"} of uint8 (N, H, W, 3) aligned arrays under one mask."""
    out = measure(outputs) >= threshold
    source = iou(out, measure(sources) >= threshold).mean()
    other = iou(out, measure(others) >= threshold).mean()
    # None: no output mask overlaps the other scan's (at luminance >= 0.7 red ink leaves no mask at all)
    return {"iou_source": float(source), "iou_other": float(other),
            "iou_ratio": float(source / other) if other > 0 else None}


def sweep(sources: np.ndarray, others: np.ndarray, targets: np.ndarray, outputs: np.ndarray | None = None) -> list[dict]:
    """One row per (mask, threshold): the perfect edit's ratio (``target``) and, given ``outputs``, the
    edit's (``edit``) and its share of the ceiling (``of_target``)."""
    rows = []
    for name, measure in MEASURES.items():
        for threshold in THRESHOLDS:
            row = {"mask": name, "threshold": threshold, "target": ratios(targets, sources, others, measure, threshold)}
            if outputs is not None:
                row["edit"] = ratios(outputs, sources, others, measure, threshold)
                edit, target = row["edit"]["iou_ratio"], row["target"]["iou_ratio"]
                row["of_target"] = edit / target if edit is not None and target else None
            rows.append(row)
    return rows


def held_out(seed: int, per_digit: int):
    """(sources, others, targets) of run ``--seed seed``'s edit stage: uint8 (N, 64, 64, 3), digit-major."""
    import proving_ground as pg
    from proving import edit
    from proving.digits import RED_INK, load_splits, render
    from proving.seeds import Seeds

    splits = load_splits(pg.RESOLUTION, Seeds(seed).split)
    sources, others, _ = edit.heldout_sources(splits, per_digit)
    return splits.heldout[sources], splits.heldout[others], render(splits.heldout_scans[sources], pg.RESOLUTION, RED_INK)


def run_outputs(run: Path, seed: int, sources: np.ndarray) -> np.ndarray:
    """The run's edits, uint8 (N, H, W, 3) in the stage's order; checks its saved sources are ``sources``."""
    from PIL import Image

    per_digit = len(sources) // 10

    def load(stage: str) -> np.ndarray:
        return np.stack([np.asarray(Image.open(run / "samples" / stage / f"{d}_{k}.png").convert("RGB"))
                         for d in range(10) for k in range(per_digit)])

    saved = load("edit_source")
    if not np.array_equal(saved, sources):
        raise SystemExit(f"{run}/samples/edit_source: not the held-out scans of --seed {seed} (another seed's run?)")
    return load("edit")


def _text(overlap: dict) -> str:
    if overlap["iou_ratio"] is None:
        return "no ink this dark"
    return f"{overlap['iou_ratio']:.3f} ({overlap['iou_source']:.2f} / {overlap['iou_other']:.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a finished proving-ground run folder (its edit samples)")
    parser.add_argument("--summary", type=Path, help="the run's JSON summary (default DIR/report.json; the run's --json if it had one)")
    parser.add_argument("--seed", type=int, help="the run's --seed (default: from the summary; without --run: 0, 1, 2)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    from krea2_diffusers.files import atomic_write

    result = {}
    if args.run is not None:
        summary = json.loads((args.summary or args.run / "report.json").read_text())
        seed = summary["seed"] if args.seed is None else args.seed
        per_digit = summary["edit"]["n"] // 10
        sources, others, targets = held_out(seed, per_digit)
        rows = sweep(sources, others, targets, run_outputs(args.run, seed, sources))
        stage = next(r for r in rows if r["mask"] == "luminance" and r["threshold"] == 0.2)["edit"]
        if (stage["iou_source"], stage["iou_other"]) != (summary["edit"]["iou_source"], summary["edit"]["iou_other"]):
            raise SystemExit(f"the stage's mask gives IoU {stage['iou_source']} / {stage['iou_other']} on the saved "
                             f"edits, the run's JSON {summary['edit']['iou_source']} / {summary['edit']['iou_other']}")
        result[str(seed)] = rows
    else:
        for seed in ([args.seed] if args.seed is not None else [0, 1, 2]):
            result[str(seed)] = sweep(*held_out(seed, 10))
    for seed, rows in result.items():
        print(f"seed {seed}: IoU ratio (with the source / with another scan of the digit); perfect edit"
              + ("; the edit, and its share of the perfect edit's" if "edit" in rows[0] else ""))
        for row in rows:
            line = f"  {row['mask']:>9} >= {row['threshold']:.1f}: perfect {_text(row['target'])}"
            if "edit" in row:
                share = "" if row["of_target"] is None else f", {row['of_target']:.3f} of perfect"
                line += f"; edit {_text(row['edit'])}{share}"
            print(line)
    if args.json:
        with atomic_write(args.json, "w") as handle:
            handle.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
