#!/usr/bin/env python
"""A third reader of a finished run's samples, outside the run: does a gain the judge reports survive a
classifier that shares neither the judge's data nor its family (issue 39: an outside classifier read the
earlier GRPO and DRaFT samples as no better than the base)?

    python bench/proving/outside_reader.py --run DIR [--summary JSON] [--seed S] [--stages base_nocfg,dpo,...]
                                           [--folder NAME=DIR ...] [--json OUT]

The reader: an RBF support-vector machine (scikit-learn's ``SVC``, its defaults) on the ink (1 - grey)
area-resized to the scans' own 8x8, the raw 64 values. The judge is a logistic regression on gradient
histograms fitted on one half of the training scans, the reward a CNN on the other half; this one is
fitted on the run's 360 held-out scans, which neither of them nor the generator ever saw (its accuracy
is 5-fold cross-validated on them). Each stage's samples are read from ``DIR/samples/<stage>/<digit>_<k>.png``
(the report's evaluation seeds); ``--folder NAME=DIR`` reads another folder of the same layout (e.g. a
stage's samples from before a change). Prints, per stage, the judge's accuracy (the run's saved reader on
the same PNGs, which equals the JSON's), the outside reader's, and how often the two read the same digit.
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

STAGES = ("base_nocfg", "base", "dpo", "grpo", "draft", "teacher_4", "student_4")
# The scans' native resolution: the reader sees what the 8x8 scans held, not the upscaling's smoothing.
SIZE = 8


def ink_vectors(images) -> np.ndarray:
    """float64 (N, 64): the ink of uint8 (N, H, W, 3) ``images`` area-resized to 8x8."""
    from proving.reader import ink

    return ink(images, SIZE).flatten(1).double().numpy()


def fit_outside_reader(images: np.ndarray, labels: np.ndarray, seed: int) -> tuple[object, float]:
    """(fitted SVC, 5-fold cross-validated accuracy) on uint8 (N, H, W, 3) ``images``, labels (N,)."""
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.svm import SVC

    x, y = ink_vectors(images), np.asarray(labels)
    folds = StratifiedKFold(5, shuffle=True, random_state=seed)
    return SVC().fit(x, y), float(cross_val_score(SVC(), x, y, cv=folds).mean())


def read_folder(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 (N, H, W, 3) images, int64 (N,) digits) from ``<digit>_<k>.png`` files, in (digit, k) order."""
    from PIL import Image

    from proving.report import sample_files

    files = sorted(sample_files(folder).items())
    images = np.stack([np.asarray(Image.open(path).convert("RGB")) for _, path in files])
    return images, np.array([digit for (digit, _), _ in files], np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--summary", type=Path, help="the run's JSON summary (default DIR/report.json; the run's --json if it had one)")
    parser.add_argument("--seed", type=int, default=None, help="the run's --seed (default: from the summary)")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--folder", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import proving_ground as pg
    from proving import digits
    from proving.reader import load_reader
    from proving.seeds import Seeds

    summary_path = args.summary or args.run / "report.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    seed = args.seed if args.seed is not None else summary.get("seed")
    if seed is None:
        # The held-out split follows the seed: a wrong one would fit the reader on the judge's own scans.
        raise SystemExit(f"--seed: needed, {summary_path} (the run's JSON, which records it) does not exist; "
                         "pass --summary (the run's --json) or --seed")
    judge_path = args.run / "work" / "judge_reader.safetensors"
    if not judge_path.exists():
        raise SystemExit(f"--run {args.run}: no {judge_path} (not a finished proving-ground run)")
    bad = [item for item in args.folder if "=" not in item]
    if bad:
        raise SystemExit(f"--folder {bad[0]}: expected NAME=DIR")
    splits = digits.load_splits(pg.RESOLUTION, Seeds(seed).split)
    reader, cv_accuracy = fit_outside_reader(splits.heldout, splits.heldout_labels, seed)
    judge = load_reader(judge_path)
    judge_heldout = float((judge.predict(splits.heldout) == splits.heldout_labels).mean())
    print(f"outside reader: RBF SVM on 8x8 ink, fitted on the {len(splits.heldout_labels)} held-out scans "
          f"(5-fold accuracy {cv_accuracy:.3f}); the judge's reader on them {judge_heldout:.3f}")
    folders = [(name, args.run / "samples" / name) for name in args.stages.split(",") if name]
    folders += [tuple(item.split("=", 1)) for item in args.folder]
    rows = {}
    for name, folder in folders:
        images, labels = read_folder(Path(folder))
        by_judge, by_outside = judge.predict(images), reader.predict(ink_vectors(images))
        rows[name] = {"judge": float((by_judge == labels).mean()), "outside": float((by_outside == labels).mean()),
                      "agree": float((by_judge == by_outside).mean()), "samples": int(len(labels))}
        json_accuracy = summary.get("stages", {}).get(name, {}).get("accuracy")
        note = "" if json_accuracy is None else f" (run JSON {json_accuracy:.3f})"
        print(f"  {name}: judge {rows[name]['judge']:.3f}{note}, outside {rows[name]['outside']:.3f}, "
              f"same reading {rows[name]['agree']:.3f} ({len(labels)} samples)")
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump({"seed": seed, "outside_cv_accuracy": cv_accuracy, "stages": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
