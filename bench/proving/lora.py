"""The concept LoRA through ``krea2 train``: the digits written in red ink (:data:`digits.RED_INK`),
captioned with a trigger word, plus the same number of ordinary black-ink scans with plain captions
as a regularization dataset (``is_regularization``: prior preservation), so that prompts without the
trigger keep giving black ink while the LoRA is loaded.

And the same concept as a user trains it (issue 39, :func:`user_lora_config`): a config that sets the
data (the concept folder with the trigger word in its captions, the regularization folder of plain
scans marked ``is_regularization``, caption dropout, the model's resolution), the steps, the learning
rate and the rank, every other key at the trainer's default (batch 1, its scheduler, the default LoRA
targets with the text-fusion blocks, the datasets' default weights: half the samples from each, issue 38); ``lora_ema`` the same with
``training.ema`` at its defaults. The only other keys are the run's own: its folder, the base, and
``training.seed`` (every run's data order and noise follow ``--seed``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .digits import RED_INK, caption, render, write_folder
from .pretraining import krea2, resume_flag

TRIGGER = "krxred ink"


@dataclass
class LoraSpec:
    steps: int
    batch_size: int = 16
    rank: int = 8
    learning_rate: float = 1e-3
    images: int = 300
    """Red-ink scans (and as many black regularization scans) drawn from the training split."""
    seed: int = 0
    concept_caption_dropout: float = 0.0
    """Share of concept images trained with an empty caption (the concept set's ``caption_dropout``)."""
    regular_caption_dropout: float = 0.0
    """Share of regularization images trained with an empty caption: CFG's unconditional branch then
    learns the base's black ink, never the concept (see FULL's comment in ``proving/settings.py``)."""
    checkpoint_every: int | None = None
    """Keep a checkpoint every N steps (None: only the last)."""
    extra_checkpoints: tuple[int, ...] = ()
    """Also keep a checkpoint (and, with ``report``, validate) after these steps (``checkpointing.steps``)."""
    report: bool = False
    """Validate at every checkpoint with the checkpoint report's metrics on (``report.json``, issue 41):
    one prompt per digit with the trigger, two seeds each, the ``pixels`` encoder (red ink is colour)."""


@dataclass
class UserLoraSpec:
    """What a user's config sets (see the module docstring)."""

    steps: int
    learning_rate: float
    rank: int
    caption_dropout: float = 0.05
    images: int = 300
    """Red-ink scans drawn from the training split (the same draw as :class:`LoraSpec`'s concept set)."""


@dataclass
class LoraResult:
    lora_file: Path
    steps: int
    seconds: float


def lora_config(spec: LoraSpec, base_dir: Path, concept: Path, regular: Path, run_dir: Path, resolution: int) -> dict:
    """The ``krea2 train`` YAML mapping of the concept LoRA (also adapts the text fusion, which must
    learn the trigger word, and the in/out projections of this narrow model); with ``spec.report`` it
    validates at every checkpoint with the checkpoint report on."""
    every = spec.checkpoint_every or spec.steps
    listed = {"steps": list(spec.extra_checkpoints)} if spec.extra_checkpoints else {}  # checkpointed and validated
    config = {
        "output_dir": str(run_dir),
        "model": {"pretrained_model_name_or_path": str(base_dir), "max_sequence_length": 32},
        "data": {"datasets": [{"path": str(concept), "caption_dropout": spec.concept_caption_dropout},
                              {"path": str(regular), "is_regularization": True, "caption_dropout": spec.regular_caption_dropout}],
                 "resolution": resolution, "caption_dropout": 0.0, "num_workers": 0},
        "training": {"method": "lora", "max_steps": spec.steps, "batch_size": spec.batch_size, "seed": spec.seed},
        "lora": {"rank": spec.rank, "alpha": spec.rank, "train_text_fusion": True,
                 "extra_modules": ["img_in", "final_layer.linear"]},
        "optimizer": {"learning_rate": spec.learning_rate},
        "lr_scheduler": {"name": "wsd", "warmup_steps": min(20, spec.steps // 10), "decay_fraction": 0.3},
        "checkpointing": {"every_n_steps": every, "keep_last": spec.steps // every + len(spec.extra_checkpoints), **listed},
        "export": {"formats": ["diffusers"], "trigger_words": [TRIGGER]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    if spec.report:
        config["validation"] = {"every_n_steps": every, **listed, "prompts": [caption(d, TRIGGER) for d in range(10)],
                                "num_inference_steps": 16, "guidance_scale": 3.0, "height": resolution,
                                "width": resolution, "seed": spec.seed, "metrics": True, "seeds_per_prompt": 2,
                                "encoder": "pixels"}
    return config


def run_lora(spec: LoraSpec, splits, base_dir: Path, work_dir: Path, out_file: Path, device: str = "cpu",
             log: Path | None = None) -> LoraResult:
    """Write the concept and regularization sets, run ``krea2 train`` and copy its LoRA to ``out_file``."""
    check_new(out_file)
    concept, regular = write_sets(splits, spec.images, spec.seed, work_dir)
    config = lora_config(spec, base_dir, concept, regular, Path(work_dir) / "run", splits.resolution)
    return train_and_copy(config, work_dir, out_file, spec.steps, device, log)


def check_new(out_file: Path) -> None:
    if Path(out_file).exists():
        raise FileExistsError(f"{out_file} already exists; the bench never overwrites a LoRA")


def write_sets(splits, images: int, seed: int, work_dir: Path) -> tuple[Path, Path]:
    """``work_dir/concept`` (red ink, the trigger in every caption) and ``work_dir/regular`` (plain black
    scans, plain captions) from :func:`concept_draw`; a folder already there (a resumed run) is kept."""
    red, black = concept_draw(splits, images, seed)
    concept, regular = Path(work_dir) / "concept", Path(work_dir) / "regular"
    if not concept.is_dir():
        write_folder(concept, render(splits.train_scans[red], splits.resolution, RED_INK),
                     [caption(d, TRIGGER) for d in splits.train_labels[red]])
    if not regular.is_dir():
        write_folder(regular, splits.train[black], [caption(d) for d in splits.train_labels[black]])
    return concept, regular


def train_and_copy(config: dict, work_dir: Path, out_file: Path, steps: int, device: str, log: Path | None,
                   config_name: str = "lora.yaml") -> LoraResult:
    """Write ``config`` to ``work_dir/config_name``, run ``krea2 train`` on it and copy the run's diffusers
    LoRA (``config["output_dir"]``) to ``out_file``. Every LoRA of the bench (concept, user, edit) trains here."""
    import shutil

    from krea2_diffusers.files import atomic_path, atomic_write

    config_path = Path(work_dir) / config_name
    with atomic_write(config_path, "w") as handle:
        handle.write(yaml.safe_dump(config, sort_keys=False))
    start = time.perf_counter()
    krea2("train", str(config_path), *resume_flag(config), device=device, log=log)
    seconds = time.perf_counter() - start
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(out_file)) as tmp:
        shutil.copyfile(Path(config["output_dir"]) / "lora_diffusers.safetensors", tmp)
    return LoraResult(Path(out_file), steps, seconds)


def user_lora_config(spec: UserLoraSpec, base_dir: Path, folder: Path, regular: Path, run_dir: Path, resolution: int,
                     seed: int, ema: bool = False) -> dict:
    """The ``krea2 train`` YAML mapping a user writes for the concept (see the module docstring);
    ``ema``: ``training.ema`` enabled with every key at its default."""
    config = {
        "output_dir": str(run_dir),
        "model": {"pretrained_model_name_or_path": str(base_dir)},
        "data": {"datasets": [{"path": str(folder)}, {"path": str(regular), "is_regularization": True}],
                 "caption_dropout": spec.caption_dropout, "resolution": resolution},
        "training": {"max_steps": spec.steps, "seed": seed},
        "lora": {"rank": spec.rank},
        "optimizer": {"learning_rate": spec.learning_rate},
        "export": {"trigger_words": [TRIGGER]},
    }
    if ema:
        config["training"]["ema"] = {}
    return config


def concept_draw(splits, images: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the training split: ``images`` scans for the concept and as many regularization scans."""
    pick = np.random.default_rng(seed).choice(len(splits.train_labels), 2 * images, replace=False)
    return pick[:images], pick[images:]


def run_user_lora(spec: UserLoraSpec, splits, base_dir: Path, work_dir: Path, out_file: Path, seed: int, ema: bool,
                  device: str = "cpu", log: Path | None = None) -> LoraResult:
    """Write the concept and regularization folders, run ``krea2 train`` on :func:`user_lora_config`
    and copy its diffusers LoRA to ``out_file``."""
    check_new(out_file)
    folder, regular = write_sets(splits, spec.images, seed, work_dir)
    config = user_lora_config(spec, base_dir, folder, regular, Path(work_dir) / "run", splits.resolution, seed, ema)
    return train_and_copy(config, work_dir, out_file, spec.steps, device, log)
