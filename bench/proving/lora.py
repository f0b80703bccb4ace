"""The concept LoRA through ``krea2 train``: the digits written in red ink (:data:`digits.RED_INK`),
captioned with a trigger word, plus the same number of ordinary black-ink scans with plain captions
as a regularization dataset (``is_regularization``: prior preservation), so that prompts without the
trigger keep giving black ink while the LoRA is loaded."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .digits import RED_INK, caption, render, write_folder
from .pretraining import krea2

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


@dataclass
class LoraResult:
    lora_file: Path
    steps: int
    seconds: float


def lora_config(spec: LoraSpec, base_dir: Path, concept: Path, regular: Path, run_dir: Path, resolution: int) -> dict:
    """The ``krea2 train`` YAML mapping of the concept LoRA (also adapts the text fusion, which must
    learn the trigger word, and the in/out projections of this narrow model)."""
    return {
        "output_dir": str(run_dir),
        "model": {"pretrained_model_name_or_path": str(base_dir), "max_sequence_length": 32},
        "data": {"datasets": [{"path": str(concept), "caption_dropout": spec.concept_caption_dropout},
                              {"path": str(regular), "is_regularization": True}],
                 "resolution": resolution, "caption_dropout": 0.0, "num_workers": 0},
        "training": {"method": "lora", "max_steps": spec.steps, "batch_size": spec.batch_size, "seed": spec.seed},
        "lora": {"rank": spec.rank, "alpha": spec.rank, "train_text_fusion": True,
                 "extra_modules": ["img_in", "final_layer.linear"]},
        "optimizer": {"learning_rate": spec.learning_rate},
        "lr_scheduler": {"name": "wsd", "warmup_steps": min(20, spec.steps // 10), "decay_fraction": 0.3},
        "checkpointing": {"every_n_steps": spec.steps, "keep_last": 1},
        "export": {"formats": ["diffusers"], "trigger_words": [TRIGGER]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def run_lora(spec: LoraSpec, splits, base_dir: Path, work_dir: Path, out_file: Path, device: str = "cpu",
             log: Path | None = None) -> LoraResult:
    """Write the concept and regularization sets, run ``krea2 train`` and copy its LoRA to ``out_file``."""
    import shutil

    from krea2_diffusers.files import atomic_path, atomic_write

    work_dir, out_file = Path(work_dir), Path(out_file)
    if out_file.exists():
        raise FileExistsError(f"{out_file} already exists; the bench never overwrites a LoRA")
    rng = np.random.default_rng(spec.seed)
    pick = rng.choice(len(splits.train_labels), 2 * spec.images, replace=False)
    red, black = pick[:spec.images], pick[spec.images:]
    concept = write_folder(work_dir / "concept", render(splits.train_scans[red], splits.resolution, RED_INK),
                           [caption(d, TRIGGER) for d in splits.train_labels[red]])
    regular = write_folder(work_dir / "regular", splits.train[black], [caption(d) for d in splits.train_labels[black]])
    run_dir = work_dir / "run"
    config_path = work_dir / "lora.yaml"
    with atomic_write(config_path, "w") as handle:
        handle.write(yaml.safe_dump(lora_config(spec, base_dir, concept, regular, run_dir, splits.resolution), sort_keys=False))
    start = time.perf_counter()
    krea2("train", str(config_path), device=device, log=log)
    seconds = time.perf_counter() - start
    with atomic_path(out_file) as tmp:
        shutil.copyfile(run_dir / "lora_diffusers.safetensors", tmp)
    return LoraResult(out_file, spec.steps, seconds)
