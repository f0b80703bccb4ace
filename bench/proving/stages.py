"""One stage's samples and row: sample every digit through ``Krea2Pipeline``, save the pinned files
``DIR/samples/<stage>/<digit>_<k>.png``, read them with the judge; and the choice of the
pretraining checkpoint post-training starts from (on the selection seeds, never the report's).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stages:
    """What every stage's sampling shares. ``eval_seed``: the report's sampling block
    (:attr:`proving.seeds.Seeds.eval`); ``rows``: {stage: row} so far."""

    out: Path
    judge: object
    per_digit: int
    resolution: int
    device: str
    eval_seed: int
    rows: dict = field(default_factory=dict)

    def sample(self, folder: str, pipe, steps: int, guidance: float, trigger: str | None = None, seed: int | None = None,
               per_digit: int | None = None, save: bool = True):
        """``per_digit`` images of every digit (default the run's) from sampling block ``seed`` (default
        the report's), saved under ``DIR/samples/<folder>`` unless ``save`` is False. Returns (images, labels)."""
        from .sampling import generate, save_samples

        images, labels = generate(None, range(10), per_digit or self.per_digit, guidance, steps,
                                  seed=self.eval_seed if seed is None else seed, trigger=trigger, device=self.device,
                                  resolution=self.resolution, pipe=pipe)
        if save:
            save_samples(self.out, folder, images, labels)
        return images, labels

    def row(self, stage: str, images, labels, what: str, steps, seconds, num_inference_steps: int, guidance: float,
            **extra) -> dict:
        """The stage's row (the judge's accuracy, FD and diversity plus what produced the samples), kept in ``rows``."""
        row = {"what": what, "steps": steps, "seconds": None if seconds is None else round(seconds, 1),
               "num_inference_steps": num_inference_steps, "guidance": guidance, **self.judge.evaluate(images, labels),
               **extra}
        print(f"[proving ground] {stage}: accuracy {row['accuracy']:.3f}, FD {row['fd']:.2f}, diversity {row['diversity']:.2f}",
              flush=True)
        self.rows[stage] = row
        return row

    def run(self, stage: str, pipe, what: str, steps, seconds, num_inference_steps: int, guidance: float,
            trigger: str | None = None, **extra):
        """:meth:`sample` into ``samples/<stage>`` then :meth:`row`. Returns (images, labels)."""
        images, labels = self.sample(stage, pipe, num_inference_steps, guidance, trigger=trigger)
        self.row(stage, images, labels, what, steps, seconds, num_inference_steps, guidance, **extra)
        return images, labels


def choose_base(stages: Stages, run_dir: Path, checkpoints: list[int], final_stage_start: int, vae_dir: Path,
                sampling_steps: int, min_error: float, select_seed: int, log: Path) -> tuple[Path, dict]:
    """The model post-training starts from: the latest checkpoint of the last (final-resolution) stage
    whose guidance-free error on the SELECTION seeds is >= ``min_error`` (room to improve, as
    post-training has on a real model), checking at most three, newest first. Returns its folder
    (``DIR/models/base``) and how it was chosen (with its selection samples' row, the curves' step 0)."""
    from krea2_diffusers.files import atomic_write_dir

    from .pretraining import export_model
    from .sampling import load_pipeline

    out = stages.out
    candidates = [c for c in sorted(checkpoints, reverse=True) if c > final_stage_start][:3]
    tried = []
    for step in candidates:
        folder = out / "work" / "candidates" / f"step-{step}"
        if not folder.exists():
            export_model(run_dir, step, vae_dir, folder, log=log)
        start = time.perf_counter()
        images, labels = stages.sample("", load_pipeline(folder, stages.device), sampling_steps, 0.0, seed=select_seed,
                                       save=False)
        point = stages.judge.evaluate(images, labels)
        tried.append({"step": step, "guidance0_error": round(1 - point["accuracy"], 4), "selection": point,
                      "sampling_seconds": round(time.perf_counter() - start, 1), "images": images, "labels": labels})
        print(f"[proving ground] checkpoint step-{step}: guidance-0 error {1 - point['accuracy']:.3f} (selection seeds)",
              flush=True)
        if 1 - point["accuracy"] >= min_error:
            break
    chosen = tried[-1]
    base = out / "models" / "base"
    if not base.exists():
        with atomic_write_dir(base) as tmp:
            shutil.copytree(out / "work" / "candidates" / f"step-{chosen['step']}", tmp, dirs_exist_ok=True)
    why = (f"latest final-stage checkpoint with guidance-0 error >= {min_error} on the selection seeds"
           if chosen["guidance0_error"] >= min_error else
           f"no checkpoint tried had guidance-0 error >= {min_error}: the oldest tried")
    return base, {"checkpoint": f"step-{chosen['step']}", "why": why,
                  "tried": [{k: v for k, v in t.items() if k not in ("images", "labels")} for t in tried],
                  "selection_images": chosen["images"], "selection_labels": chosen["labels"]}
