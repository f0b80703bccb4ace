"""What the Train tab's buttons do, on plain values (no Gradio here): the plan, start, stop,
resume, status and captions. Refusals raise :class:`train_tab.images.TrainInputError` with the
message the UI shows; nothing is written before a start is accepted, and then only in the run
folder."""

from __future__ import annotations

from pathlib import Path

from krea2_diffusers.models.tiny import is_tiny

from .images import Captioner, TrainInputError, caption_table, check_image, find_images
from .plan import Fit, fit
from .presets import TRAIN_PRESETS, run_config
from .runs import Runs

PLACEHOLDER_RUN = Path("RUN")  # the plan's config needs paths; the dry run reads neither
MAX_STEPS = 100_000


class TrainActions:
    """Args:
        runs: the runs folder.
        base_model: the default base model (the app's RAW model).
        captioner_model: the Qwen3-VL captions come from (default: the base model's own).
        gpu_memory_gib: plan for a card of this size instead of the GPU found (or the preset's card).
    """

    def __init__(self, runs: Runs, base_model: str, captioner_model: str | None = None, gpu_memory_gib: float | None = None):
        self.runs, self.base_model, self.gpu_memory_gib = runs, base_model, gpu_memory_gib
        self.captioner_model = captioner_model
        self._captioners: dict[str, Captioner] = {}

    # ---------------------------------------------------------------- inputs
    @staticmethod
    def check_preset(preset: str) -> str:
        if preset not in TRAIN_PRESETS:
            raise TrainInputError(f"Unknown preset {preset!r}; choose one of {', '.join(TRAIN_PRESETS)}.")
        return preset

    def base(self, base_model: str | None) -> str:
        return (base_model or "").strip() or self.base_model

    def images(self, images_folder: str, rows: list[list[str]] | None = None) -> list[list[str]]:
        """``[path, caption]`` rows: the given ones (the UI's edited table, each image checked), else the folder's."""
        if rows:
            for path, _ in rows:
                if not Path(path).is_file():
                    raise TrainInputError(f"{path} no longer exists; load the images again.")
                check_image(Path(path))
            return rows
        return caption_table(find_images(images_folder))

    def captioner(self, base_model: str) -> Captioner:
        model = "tiny-random" if is_tiny(base_model) else (self.captioner_model or base_model)
        if model not in self._captioners:
            self._captioners[model] = Captioner(model, tiny=is_tiny(model))
        return self._captioners[model]

    def caption_missing(self, rows: list[list[str]], base_model: str | None, progress=None) -> list[list[str]]:
        if not rows:
            raise TrainInputError("Load the images first.")
        return self.captioner(self.base(base_model)).caption_missing(rows, progress)

    # ---------------------------------------------------------------- the plan
    def config_for(self, run_dir: Path, manifest: Path, preset: str, base_model: str, trigger_word: str = "", steps=None,
                   sample_every=None, prompt: str = "") -> dict:
        steps = int(steps) if steps else TRAIN_PRESETS[preset].steps
        if not 1 <= steps <= MAX_STEPS:
            raise TrainInputError(f"Steps must be between 1 and {MAX_STEPS}, got {steps}.")
        every = int(sample_every) if sample_every else max(1, steps // 4)
        return run_config(run_dir, manifest, preset, base_model, trigger_word.strip(), steps, every,
                          prompt or trigger_word.strip() or "a photo")

    def plan(self, images_folder: str, preset: str, base_model: str | None, rows=None) -> Fit:
        """The memory plan for these images (checked: the plan of a run that cannot start is no use)."""
        self.check_preset(preset)
        self.images(images_folder, rows)
        base = self.base(base_model)

        def config(name: str) -> dict:
            return self.config_for(PLACEHOLDER_RUN, PLACEHOLDER_RUN / "dataset.jsonl", name, base)

        try:
            return fit(config(preset), preset, self.gpu_memory_gib, suggest=config)
        except (ValueError, OSError) as err:  # a base model that cannot be read, a config the trainer refuses
            raise TrainInputError(f"No plan for base model {base!r}: {err}") from None

    # ---------------------------------------------------------------- runs
    def start(self, images_folder: str, preset: str, base_model: str | None, trigger_word: str = "", steps=None,
              sample_every=None, rows=None, copy_images: bool = False) -> str:
        """Check everything, then create the run folder and start ``krea2 train``; returns the run id."""
        busy = self.runs.running()
        if busy is not None:
            raise TrainInputError(f"Run {busy} is still running: stop it before starting another.")
        rows = self.images(images_folder, rows)
        missing = [Path(p).name for p, caption in rows if not caption.strip()]
        if missing:
            raise TrainInputError(f"{len(missing)} image(s) have no caption ({', '.join(missing[:3])}): press "
                                  "'Caption missing ones' or write them in the table.")
        base = self.base(base_model)
        planned = self.plan(images_folder, preset, base, rows)
        if not planned.fits:
            raise TrainInputError(f"Not started. {planned.text.splitlines()[0]}")
        trigger = (trigger_word or "").strip()
        prompt = rows[0][1] if not trigger or trigger in rows[0][1] else f"{trigger}, {rows[0][1]}"

        def config(run_dir: Path, manifest: Path) -> dict:
            return self.config_for(run_dir, manifest, preset, base, trigger, steps, sample_every, prompt)

        run_id = self.runs.create(config, rows, trigger, copy=copy_images)
        self.runs.start(run_id, env=self.environment(base))
        return run_id

    @staticmethod
    def environment(base_model: str) -> dict:
        """tiny-random's matrices are too small for threads to help: one thread is faster."""
        return {"OMP_NUM_THREADS": "1"} if is_tiny(base_model) else {}

    def resume(self, run_id: str) -> None:
        base = self.runs.config(run_id)["model"]["pretrained_model_name_or_path"]
        self.runs.start(run_id, resume=True, env=self.environment(base))

    def stop(self, run_id: str) -> str:
        if not self.runs.stop(run_id):
            return f"Run {run_id} is not running ({self.runs.state(run_id)})."
        return f"Stopping {run_id}: it saves a checkpoint, then exits (Resume continues from there)."

    def progress(self, run_id: str) -> str:
        """``step / total · s/step · ETA · loss`` from ``metrics.jsonl``."""
        status, rows = self.runs.status(run_id), self.runs.metrics(run_id)
        text = f"**{run_id}**: {status['state']}, step {status['step']} / {status['total']}"
        times = [r["step_time"] for r in rows[1:][-20:] if "step_time" in r]  # the first step includes the set-up
        if times:
            per_step = sum(times) / len(times)
            text += f" · {per_step:.2f} s/step"
            if status["state"] == "running":
                text += f" · ETA {per_step * (status['total'] - status['step']):.0f} s"
        if status["loss"] is not None:
            text += f" · loss {status['loss']:.4f}"
        if status["state"] == "failed":
            text += f"\n\n```\n{self.runs.log_tail(run_id)}\n```"
        return text
