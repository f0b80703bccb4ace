"""The run's side of the report: what it keeps in ``<output_dir>/report/`` and one row per validation.

* ``base/``: the base model's samples of the report's prompts (:mod:`~finetune.report.plan`),
  made once per run, before the first step, and ``base/plan.json``, the settings they were made
  with (a resumed run with other validation settings makes them again).
* ``samples/step-N/``: the report's samples beyond the ordinary validation ones (other seeds, the
  prompts without the trigger); copy 0 of a validation prompt is ``samples/step-N/raw-NN.png``.
* ``reference.json``: the levels every row is read against (:class:`~finetune.report.metrics.Reference`),
  the encoder's name and the plan.
* ``metrics.jsonl``: one row per validation (a resumed run cuts it back to its checkpoint's step).

Everything here runs on the main process; sampling is the validator's (every process takes part
under FSDP).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from krea2_diffusers.files import atomic_write

from . import metrics as m
from .features import load_features
from .layout import FOLDER, image_name, read_rows
from .plan import SamplePlan, plan_for

logger = logging.getLogger("finetune")

MAX_TRAINING_IMAGES = 256
"""Training images compared with (evenly spaced over the dataset beyond this many)."""
NEAR_COPIES = 16
"""Training images put through the VAE for the near-copy level (:mod:`~finetune.report.metrics`)."""


@dataclass(frozen=True)
class TrainingImage:
    path: Path
    crop: tuple[int, int, int, int] | None = None

    def load(self):
        import PIL.Image

        with PIL.Image.open(self.path) as image:
            image = image.convert("RGB")
            return image.crop(self.crop) if self.crop is not None else image


def training_images(config, samples) -> list[TrainingImage]:
    """The distinct images the run learns (regularization datasets left out), at most
    :data:`MAX_TRAINING_IMAGES` of them."""
    entries = config.data.datasets
    distinct = list(dict.fromkeys(TrainingImage(s.image_path, s.crop) for s in samples
                                  if not (entries and entries[s.dataset].is_regularization)))
    if len(distinct) > MAX_TRAINING_IMAGES:
        distinct = [distinct[i * len(distinct) // MAX_TRAINING_IMAGES] for i in range(MAX_TRAINING_IMAGES)]
    return distinct


class ReportCollector:
    """Measures the samples of each validation against the training images and the base's samples.

    ``images``: the run's :func:`training_images`; ``start_step``: the step the run (re)starts from.
    """

    def __init__(self, config, images: list[TrainingImage], out_dir: Path, is_main: bool, start_step: int):
        self.config = config
        self.plan: SamplePlan = plan_for(config)
        self.images = images
        self.out = out_dir
        self.folder = out_dir / FOLDER
        self.is_main = is_main
        self.encoder = None
        self.center = None  # (D,) the run's mean image feature
        self.train = None  # (T, D) features of the training images
        self.reference = None
        self.base = None  # {(kind, index): ((B, D) features, (B, 3, h, w) pixels)}
        self.started = time.perf_counter()
        self.offset = 0.0  # seconds of the run before this process (a resumed run)
        if is_main:
            rows = [r for r in read_rows(out_dir) if r["step"] <= start_step]
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.folder / "metrics.jsonl", "w") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in rows)
            self.offset = rows[-1]["seconds"] if rows else 0.0

    # ------------------------------------------------------------------ base samples
    def base_settings(self) -> dict:
        v, model = self.config.validation, self.config.model
        return {"plan": self.plan.to_dict(), "model": model.pretrained_model_name_or_path, "height": v.height,
                "width": v.width, "num_inference_steps": v.num_inference_steps, "guidance_scale": v.guidance_scale,
                "negative_prompt": v.negative_prompt}

    def has_base(self) -> bool:
        """Whether ``base/`` holds the base's samples for the current settings (main process)."""
        marker = self.folder / "base" / "plan.json"
        if not marker.exists() or json.loads(marker.read_text()) != json.loads(json.dumps(self.base_settings())):
            return False
        return all((self.folder / "base" / image_name(p, k)).exists() for p, k in self.plan.base_samples())

    def save_base(self, images: list) -> None:
        """The base's samples, in the order of ``plan.base_samples()``."""
        folder = self.folder / "base"
        folder.mkdir(parents=True, exist_ok=True)
        for (prompt, copy), image in zip(self.plan.base_samples(), images):
            image.save(folder / image_name(prompt, copy))
        with atomic_write(folder / "plan.json", "w") as handle:
            json.dump(self.base_settings(), handle, indent=2)

    # ------------------------------------------------------------------ per validation
    def measure(self, step: int, validation_images: list, extra_images: list, pipe, device,
                sampling_seconds: float = 0.0) -> dict:
        """One row from a validation's images: ``validation_images`` one per validation prompt (copy 0),
        ``extra_images`` in the order of ``plan.extra_samples()``. Saves the extra images, appends
        the row to ``metrics.jsonl`` and rewrites ``report.json`` / ``report.html``."""
        from .writer import write_report

        start = time.perf_counter()
        folder = self.folder / "samples" / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        images, paths = {}, {}
        for prompt in self.plan.prompts:
            if prompt.validation_index is not None:
                images[(prompt, 0)] = validation_images[prompt.validation_index]
                paths[(prompt, 0)] = f"samples/step-{step:06d}/raw-{prompt.validation_index:02d}.png"
        for (prompt, copy), image in zip(self.plan.extra_samples(), extra_images):
            image.save(folder / image_name(prompt, copy))
            images[(prompt, copy)] = image
            paths[(prompt, copy)] = f"{FOLDER}/samples/step-{step:06d}/{image_name(prompt, copy)}"
        self._prepare(pipe, device)
        row = self._row(step, images)
        row["images"] = {kind: [[paths[(p, k)] for k in range(self.plan.seeds_per_prompt)] for p in self.plan.prompts
                                if p.kind == kind] for kind in ("concept", "plain")}
        row["seconds"] = round(self.offset + time.perf_counter() - self.started, 3)
        row["metrics_seconds"] = round(sampling_seconds + time.perf_counter() - start, 3)
        with (self.folder / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        write_report(self.out)
        return row

    def _row(self, step: int, images: dict) -> dict:
        plan, reference = self.plan, self.reference
        groups = {p: [images[(p, k)] for k in range(plan.seeds_per_prompt)] for p in plan.prompts}
        features = {p: self._unit(self.encoder(group)) for p, group in groups.items()}
        concept_features = [features[p] for p in plan.concept]
        everything = torch.cat(list(features.values()))
        mean, share = m.concept(torch.cat(concept_features) if concept_features else everything[:0], self.train,
                                reference.concept_threshold)
        leak = (None, None, None)
        if self.base is not None and plan.plain:
            base = [self.base[(p.kind, p.index)] for p in plan.plain]
            leak = m.leak([features[p] for p in plan.plain], [m.to_pixels(groups[p]) for p in plan.plain],
                          [b[0] for b in base], [b[1] for b in base], reference)
        return {"step": step, "concept": mean, "concept_share": share, "leak": leak[0], "copying": m.copying(everything, self.train),
                "diversity": m.diversity(list(features.values())), "leak_feature": leak[1], "leak_pixel": leak[2]}

    def _prepare(self, pipe, device) -> None:
        """Once per process: the encoder, the training images' features and the reference levels."""
        if self.encoder is not None:
            return
        import PIL.Image

        self.encoder = load_features(self.config.validation.encoder, pipe.text_encoder, device)
        pictures = [image.load() for image in self.images]
        train = self.encoder(pictures)
        copies = self.encoder(near_copies(pipe, pictures[:NEAR_COPIES], self.config.validation))
        base_folder, base = self.folder / "base", {}
        if self.has_base():
            for prompt in self.plan.prompts:
                group = []
                for copy in range(self.plan.base_copies):
                    with PIL.Image.open(base_folder / image_name(prompt, copy)) as image:
                        group.append(image.convert("RGB"))
                base[(prompt.kind, prompt.index)] = (self.encoder(group), m.to_pixels(group))
        else:
            logger.warning("report: no base-model samples in %s for these validation settings; leak and concept share "
                           "are not measured", base_folder)
        # Cosines about the run's own mean image (training images and base samples): what all images
        # share (an encoder's common direction, strong in random and anisotropic encoders) drops out.
        self.center = torch.cat([train] + [features for features, _ in base.values()]).mean(0)
        self.train, self.copies = self._unit(train), self._unit(copies)
        self.base = {key: (self._unit(features), pixels) for key, (features, pixels) in base.items()} or None
        self.reference = self._reference()
        with atomic_write(self.folder / "reference.json", "w") as handle:
            json.dump({"encoder": self.encoder.name, "reference": self.reference.to_dict(), "plan": self.plan.to_dict(),
                       "training_images": len(self.images)}, handle, indent=2)

    def _unit(self, features: torch.Tensor) -> torch.Tensor:
        """(N, D) pooled features -> centred on the run's mean image, of unit norm."""
        return torch.nn.functional.normalize(features - self.center, dim=-1)

    def _reference(self) -> m.Reference:
        near = m.near_copy(self.train, self.copies)
        if self.base is None:
            return m.Reference(near, None, None, None, None, None)
        seeds = self.plan.seeds_per_prompt
        concept = [self.base[(p.kind, p.index)][0] for p in self.plan.concept]
        everything = torch.cat([features for features, _ in self.base.values()])
        plain = [self.base[(p.kind, p.index)] for p in self.plan.plain]
        seed_feature, seed_pixel = m.seed_distances([f for f, _ in plain], [p for _, p in plain])
        return m.Reference(
            near_copy=near, base_concept=m.concept(torch.cat(concept), self.train, None)[0] if concept else None,
            base_copying=m.copying(everything, self.train),
            base_diversity=m.diversity([features[:seeds] for features, _ in self.base.values()]),
            seed_feature=seed_feature, seed_pixel=seed_pixel)


@torch.no_grad()
def near_copies(pipe, pictures: list, validation) -> list:
    """The pictures through the pipeline's VAE (encoded, decoded), each first resized to multiples of
    16 pixels, no larger than a validation sample: what a sample that memorised them looks like."""
    import numpy as np
    import PIL.Image

    from krea2_diffusers.latents import decode_latents

    from ..data.encoding import encode_images

    out = []
    for picture in pictures:
        scale = min(1.0, (validation.height * validation.width / (picture.width * picture.height)) ** 0.5)
        size = (max(16, int(picture.width * scale) // 16 * 16), max(16, int(picture.height * scale) // 16 * 16))
        pixels = torch.from_numpy(np.asarray(picture.resize(size, PIL.Image.BICUBIC), dtype=np.float32) / 255)
        decoded = decode_latents(pipe.vae, encode_images(pipe, pixels.permute(2, 0, 1)[None]))[0]
        out.append(PIL.Image.fromarray((decoded.permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)))
    return out


def collector_for(config, samples, out_dir: Path, is_main: bool, start_step: int) -> ReportCollector | None:
    """The run's collector when ``validation.metrics`` is on (None when off): by default on for a
    ``krea2 train`` run with validation prompts that is not a ``data.references`` run."""
    v = config.validation
    wanted = v.metrics if v.metrics is not None else bool(v.prompts) and config.data.references is None
    if not wanted or not config.requires_data or samples is None:
        return None
    return ReportCollector(config, training_images(config, samples), out_dir, is_main, start_step)
