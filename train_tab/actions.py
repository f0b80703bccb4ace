"""What the Train tab's buttons do, on plain values (no Gradio here): the plan, start (or queue),
stop, resume, status, captions, "Sample now" / "Save now" and exporting a kept checkpoint. Refusals
raise :class:`train_tab.images.TrainInputError` with the message the UI shows; nothing is written
before a start is accepted, and then only in the run folder. Every path a request names (image
folder, table rows, base model) is checked against the data roots (:mod:`train_tab.roots`) before
it is read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from PIL import Image

from finetune.data.dataset import DatasetError, Sample
from finetune.data.datasets import share_line
from finetune.data.masks import MASK_SUFFIX, attach_masks, mask_candidates
from finetune.data.pairs import check_pairs, references_by_name
from krea2_diffusers.models.tiny import is_tiny

from .checkpoints import export_step
from .errors import TrainInputError
from .images import Captioner, caption_table, check_image, find_images, thumbnail
from .plan import Fit, fit
from .presets import TRAIN_OPTIMIZERS, TRAIN_PRESETS, run_config
from .roots import DataRoots
from .runs import REGULARIZATION_NAME, Runs

PLACEHOLDER_RUN = Path("RUN")  # the plan's config needs paths; the dry run reads neither
MAX_STEPS = 100_000
PRIOR_SHARE = 0.5
"""The regularisation images' default share of the samples drawn (``prior_share``): one class image
per subject image, as DreamBooth pairs them."""
CAPTION_MODES = ("required", "trigger")
"""``captions`` of a start: ``required``: every image needs a caption; ``trigger``: an image without
one is trained with the trigger word as its caption (ai-toolkit's behaviour for uncaptioned images)."""


def share(field: str, value, default: float) -> float:
    """``value`` as a share strictly between 0 and 1; empty means ``default``. Anything else is refused
    with a message naming ``field`` and the value."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not 0.0 < number < 1.0:
        raise TrainInputError(f"{field} must be a number between 0 and 1 (exclusive: 0.5 trains half the steps on each), "
                              f"got {value!r}.")
    return number


def whole_number(field: str, value, low: int, high: int, default: int) -> int:
    """``value`` as an integer in [low, high]; empty or 0 means ``default``. Anything else (a
    fraction, a negative number, text) is refused with a message naming ``field`` and the value."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if number == 0:
        return default
    if not (number.is_integer() and low <= number <= high):
        raise TrainInputError(f"{field} must be a whole number between {low} and {high} (or 0 for the default), "
                              f"got {value!r}.")
    return int(number)


class TrainActions:
    """Args:
        runs: the runs folder.
        base_model: the default base model (the app's RAW model).
        captioner_model: the Qwen3-VL captions come from (default: the base model's own).
        gpu_memory_gib: plan for a card of this size instead of the GPU found (or the preset's card).
        roots: the folders images and base models may come from (default: the runs folder's parent).
        models: the app's other configured models (allowed as base models wherever they are).
        text_encoder, vae: the app's own (``--text-encoder``, ``--vae``), written into each run's
            ``model`` section for the trainer to read beside a transformer file (None: its defaults).
    """

    def __init__(self, runs: Runs, base_model: str, captioner_model: str | None = None, gpu_memory_gib: float | None = None,
                 roots: DataRoots | None = None, models: tuple[str, ...] = (), text_encoder: str | None = None,
                 vae: str | None = None):
        self.runs, self.base_model, self.gpu_memory_gib = runs, base_model, gpu_memory_gib
        self.captioner_model = captioner_model
        self.encoders = {"text_encoder": text_encoder, "vae": vae}
        self.roots = roots if roots is not None else DataRoots([runs.root.parent])
        self.models = (base_model, *models)
        self._captioners: dict[str, Captioner] = {}

    # ---------------------------------------------------------------- inputs
    @staticmethod
    def check_preset(preset: str) -> str:
        if preset not in TRAIN_PRESETS:
            raise TrainInputError(f"Unknown preset {preset!r}; choose one of {', '.join(TRAIN_PRESETS)}.")
        return preset

    def base(self, base_model: str | None) -> str:
        """The base model named (default: the app's), checked against the data roots before anything reads it."""
        return self.roots.base_model((base_model or "").strip() or self.base_model, self.models)

    def images(self, images_folder: str, rows: list[list[str]] | None = None) -> list[list[str]]:
        """``[path, caption]`` rows: the given ones (the UI's edited table, each image checked), else the folder's."""
        if rows:
            for number, (path, _) in enumerate(rows, 1):
                image = self.roots.image(path, number)
                if not image.is_file():
                    raise TrainInputError(f"{path} no longer exists; load the images again.")
                check_image(image)
            return rows
        return caption_table(find_images(images_folder, self.roots), self.roots)

    def thumbnails(self, rows: list[list[str]]) -> list[tuple[object, str]]:
        """(small PIL image, caption) per row, for the grid; the rows are checked like :meth:`images`."""
        return [(thumbnail(path), caption) for path, caption in self.images("", rows)] if rows else []

    def captioner(self, base_model: str) -> Captioner:
        model = "tiny-random" if is_tiny(base_model) else (self.captioner_model or base_model)
        if model not in self._captioners:
            self._captioners[model] = Captioner(model, tiny=is_tiny(model))
        return self._captioners[model]

    def caption_missing(self, rows: list[list[str]], base_model: str | None = None, progress=None) -> list[list[str]]:
        """``rows`` with every empty caption written by the captioner (the ``/train_caption`` endpoint)."""
        if not rows:
            raise TrainInputError("Load the images first (rows of [image path, caption]).")
        return self.captioner(self.base(base_model)).caption_missing(self.images("", rows), progress)

    @staticmethod
    def counts(preset: str, steps=None, sample_every=None) -> tuple[int, int]:
        """(steps, sample every) as whole numbers in range; 0 or empty: the preset's steps, steps / 4."""
        steps = whole_number("Steps", steps, 1, MAX_STEPS, TRAIN_PRESETS[preset].steps)
        return steps, whole_number("Sample every", sample_every, 1, steps, max(1, steps // 4))

    # ---------------------------------------------------------------- the plan
    def config_for(self, run_dir: Path, manifest: Path, preset: str, base_model: str, trigger_word: str = "", steps=None,
                   sample_every=None, prompt: str = "", masks: bool = False, regularization: bool = False,
                   references: list[str] | None = None, optimizer: str = "adamw", prior_share: float = PRIOR_SHARE) -> dict:
        """``regularization``: the run has regularisation images (``regularization.jsonl`` in ``run_dir``),
        drawn for ``prior_share`` of the samples; ``references``: a pairs run (edit / reference LoRA),
        these the validation sample's references."""
        steps, every = self.counts(preset, steps, sample_every)
        return run_config(run_dir, manifest, preset, base_model, trigger_word.strip(), steps, every,
                          prompt or trigger_word.strip() or "a photo", masks,
                          run_dir / REGULARIZATION_NAME if regularization else None, references, optimizer,
                          prior_share=prior_share, **self.encoders)

    def pair_references(self, rows: list[list[str]], references_folder: str) -> list[list[str]]:
        """Pairs mode: each image's references from ``references_folder`` (inside the data roots),
        ``NAME.png`` or ``NAME_1.png``, ``NAME_2.png`` ... for the image ``NAME.png``; refused,
        naming the file, when an image has none, one is not an image, one belongs to no image, or an
        image has more than ``data.references.max_references`` (3)."""
        from finetune.config import ReferencesConfig

        folder = self.roots.folder(references_folder)
        if not folder.is_dir():
            raise TrainInputError(f"{folder} is not a folder (the references folder of a pairs run).")
        try:
            owned = references_by_name(folder, [Path(path).stem for path, _ in rows])
            samples = [Sample(Path(path), caption, 1, 1, references=tuple(owned.get(Path(path).stem, []))) for path, caption in rows]
            check_pairs(samples, ReferencesConfig())
        except DatasetError as err:
            raise TrainInputError(f"{err}.") from None
        for sample in samples:
            for reference in sample.references:
                if not self.roots.contains(reference):
                    raise self.roots.refusal(f"the reference {reference.name}")
        return [[str(r) for r in sample.references] for sample in samples]

    def check_masks(self, rows: list[list[str]]) -> None:
        """Refuses masks that cannot train: none beside the images, one outside the data roots, or one
        :func:`finetune.data.masks.attach_masks` refuses (wrong size, black everywhere)."""
        found = [mask for path, _ in rows for mask in mask_candidates(Path(path), True)]
        if not found:
            example = Path(rows[0][0]) if rows else Path("NAME.png")
            raise TrainInputError(f"Masks are on, but none of the {len(rows)} images has one beside it "
                                  f"(e.g. {example.stem}{MASK_SUFFIX}.png: white trains, black is ignored).")
        for mask in found:
            if not self.roots.contains(mask):
                raise self.roots.refusal(f"the mask {mask.name}")
        samples = []
        for path, caption in rows:
            with Image.open(path) as image:
                samples.append(Sample(Path(path), caption, *image.size))
        try:
            attach_masks(samples, True)
        except DatasetError as err:
            raise TrainInputError(f"{err}.") from None

    def regularization_rows(self, folder: str) -> list[list[str]]:
        """The regularisation images of ``folder`` (inside the data roots), each with its caption (the
        class prompt, from a same-name ``.txt``); refused when one has none."""
        rows = caption_table(find_images(folder, self.roots), self.roots)
        missing = [Path(p).name for p, caption in rows if not caption.strip()]
        if missing:
            raise TrainInputError(f"{len(missing)} regularisation image(s) have no caption ({', '.join(missing[:3])}): "
                                  "give each a same-name .txt with its class prompt (e.g. 'a photo of a dog').")
        return rows

    def plan(self, images_folder: str, preset: str, base_model: str | None, rows=None, optimizer: str = "adamw",
             regularization_folder: str = "", prior_share=None) -> Fit:
        """The memory plan for these images (checked: the plan of a run that cannot start is no use),
        then each dataset's share of the samples drawn (with ``regularization_folder``: ``prior_share``
        for its images, default :data:`PRIOR_SHARE`)."""
        self.check_preset(preset)
        images = self.images(images_folder, rows)
        base = self.base(base_model)
        regularization = self.regularization_rows(regularization_folder) if (regularization_folder or "").strip() else None
        prior = share("prior_share", prior_share, PRIOR_SHARE) if regularization is not None else PRIOR_SHARE

        def config(name: str) -> dict:
            return self.config_for(PLACEHOLDER_RUN, PLACEHOLDER_RUN / "dataset.jsonl", name, base, optimizer=optimizer)

        try:
            planned = fit(config(preset), preset, self.gpu_memory_gib, suggest=config)
        except (ValueError, OSError) as err:  # a base model that cannot be read, a config the trainer refuses
            raise TrainInputError(f"No plan for base model {base!r}: {err}") from None
        if regularization is None:
            shares = share_line(f"images ({len(images)})", 1.0, "the only dataset")
        else:  # the weights run_config writes: their shares (krea2 train draws by weight, whatever the sizes)
            shares = "\n".join([share_line(f"images ({len(images)})", 1.0 - prior),
                                share_line(f"regularisation ({len(regularization)} images)", prior, f"prior_share {prior:g}")])
        return dataclasses.replace(planned, text=f"{planned.text}\n{shares}")

    # ---------------------------------------------------------------- runs
    def start(self, images_folder: str, preset: str, base_model: str | None, trigger_word: str = "", steps=None,
              sample_every=None, rows=None, copy_images: bool = False, captions: str = "required", masks: bool = False,
              regularization_folder: str = "", references_folder: str = "", optimizer: str = "adamw",
              prior_share=None) -> str:
        """Check everything, then create the run folder and start ``krea2 train`` (queued while another
        run trains: it starts when the runs before it end); returns the run id.
        ``captions``: one of :data:`CAPTION_MODES`. ``masks``: train each image where its
        ``NAME.mask.png`` beside it is white. ``regularization_folder``: captioned images of the
        subject's class, trained beside it to keep the class prior (``data.datasets``).
        ``references_folder``: pairs mode (edit / reference LoRA): the images are the targets, their
        captions the instructions, and each one's reference images are read from this folder.
        ``optimizer``: one of :data:`~train_tab.presets.TRAIN_OPTIMIZERS` (``prodigy`` sets its own step size).
        ``prior_share``: the regularisation images' share of the samples drawn, in (0, 1) (default
        :data:`PRIOR_SHARE`, whatever the two folders' sizes)."""
        if captions not in CAPTION_MODES:
            raise TrainInputError(f"captions must be one of {', '.join(map(repr, CAPTION_MODES))}, got {captions!r}.")
        if optimizer not in TRAIN_OPTIMIZERS:
            raise TrainInputError(f"optimizer must be one of {', '.join(map(repr, TRAIN_OPTIMIZERS))}, got {optimizer!r}.")
        self.counts(self.check_preset(preset), steps, sample_every)  # refused before the images are read
        # only with regularisation images (without, nothing reads it): refused before any folder is read
        prior = share("prior_share", prior_share, PRIOR_SHARE) if (regularization_folder or "").strip() else PRIOR_SHARE
        base = self.base(base_model)
        trigger = (trigger_word or "").strip()
        rows = self.images(images_folder, rows)
        if captions == "trigger":
            if not trigger:
                raise TrainInputError("captions='trigger' trains on the trigger word as the caption: give a trigger word.")
            rows = [[path, caption if caption.strip() else trigger] for path, caption in rows]
        missing = [Path(p).name for p, caption in rows if not caption.strip()]
        if missing:
            raise TrainInputError(f"{len(missing)} image(s) have no caption ({', '.join(missing[:3])}): caption them "
                                  "with /train_caption (the 'Caption missing ones' button) or write them in the table, "
                                  "or start with captions='trigger' to use the trigger word as their caption.")
        if masks and copy_images:
            raise TrainInputError("Masks are read from NAME.mask.png beside each image in its folder; uploaded images "
                                  "have none: give the images folder instead.")
        if masks:
            self.check_masks(rows)
        regularization = self.regularization_rows(regularization_folder) if (regularization_folder or "").strip() else None
        references = self.pair_references(rows, references_folder) if (references_folder or "").strip() else None
        planned = self.plan(images_folder, preset, base, rows, optimizer)
        if not planned.fits:
            raise TrainInputError(f"Not started. {planned.text.splitlines()[0]}")
        prompt = rows[0][1] if not trigger or trigger in rows[0][1] else f"{trigger}, {rows[0][1]}"

        def config(run_dir: Path, manifest: Path) -> dict:
            return self.config_for(run_dir, manifest, preset, base, trigger, steps, sample_every, prompt, masks,
                                   regularization is not None, references[0] if references else None, optimizer, prior)

        return self.runs.create_and_start(config, rows, trigger, copy=copy_images, regularization=regularization,
                                          references=references)

    def resume(self, run_id: str) -> None:
        self.runs.start(run_id, resume=True)

    def started(self, run_id: str) -> str:
        """What a start says: started, or queued at its place."""
        position = self.runs.queue_position(run_id)
        if position is None:
            return f"Started {run_id}."
        before = "the run before it ends" if position == 1 else f"the {position} runs before it end"
        return f"Queued {run_id} (position {position}): it starts when {before}."

    def stop(self, run_id: str) -> str:
        if self.runs.dequeue(run_id):
            return f"Removed {run_id} from the queue: it never started (Resume starts it)."
        if not self.runs.stop(run_id):
            return f"Run {run_id} is not running ({self.runs.state(run_id)})."
        return f"Stopping {run_id}: it saves a checkpoint, then exits (Resume continues from there)."

    def sample_now(self, run_id: str) -> str:
        """The running run samples its validation prompts (and measures its report) after its current step."""
        self.runs.ask(run_id, "sample")
        return f"Asked {run_id} for a sample set after its current step (it keeps training)."

    def save_now(self, run_id: str) -> str:
        """The running run saves a checkpoint after its current step."""
        self.runs.ask(run_id, "save")
        return f"Asked {run_id} for a checkpoint after its current step (it keeps training)."

    def export_step(self, run_id: str, step) -> list[str]:
        """Checkpoint ``step`` of the run exported into ``RUN/exports/step-N/``; the files written."""
        return [str(p) for p in export_step(self.runs.folder(run_id), self.runs.config(run_id), step)]

    def progress(self, run_id: str) -> str:
        """``state, step / total · loss`` from ``metrics.jsonl`` (and the log's tail of a failed run)."""
        status = self.runs.status(run_id)
        if status["state"] == "queued":
            return (f"**{run_id}**: queued, position {status['queue_position']} of {len(self.runs.waiting())} "
                    f"({status['total']} steps; it starts when the run before it ends)")
        text = f"**{run_id}**: {status['state']}, step {status['step']} / {status['total']}"
        if status["loss"] is not None:
            text += f" · loss {status['loss']:.4f}"
        if status["state"] == "failed":
            text += f"\n\n```\n{self.runs.log_tail(run_id)}\n```"
        return text

    def speed(self, run_id: str) -> str:
        """``s/step`` (the mean of the last 20 steps) and, while running, the ETA, from ``metrics.jsonl``."""
        status, rows = self.runs.status(run_id), self.runs.metrics(run_id)
        times = [r["step_time"] for r in rows[1:][-20:] if "step_time" in r]  # the first step includes the set-up
        if not times:
            return "s/step: after the second step"
        per_step = sum(times) / len(times)
        text = f"**{per_step:.2f} s/step**"
        if status["state"] == "running":
            text += f"  \nETA {duration(per_step * (status['total'] - status['step']))}"
        return text

    def timeline(self, run_id: str) -> list[tuple[str, str]]:
        """Every validation sample (``samples/step-N/*.png``) as (path, ``"step N"``), in step order."""
        found = []
        for folder in (self.runs.folder(run_id) / "samples").glob("step-*"):
            step = folder.name.removeprefix("step-")
            if step.isdigit():
                found += [(int(step), str(p)) for p in sorted(folder.glob("*.png"))]
        return [(path, f"step {step}") for step, path in sorted(found)]


def duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 20 s"``, ``"2 h 05 min"``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
