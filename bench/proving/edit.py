"""The edit LoRA on real pairs (issue 39): ``krea2 train`` with ``data.references`` on pairs made from
the scans (reference: a training scan in black ink; target: the same scan in red ink; instruction
:data:`INSTRUCTION`), then ``Krea2Pipeline(reference_images=[scan])`` on HELD-OUT scans it never saw.

Measured on each output against its source scan: the concept (:func:`proving.digits.shows_red_ink`),
the judge's reading of the source's digit, and the overlap (IoU) of the output's ink mask with the
source's against the overlap with ANOTHER held-out scan of the same digit (the next one of that
digit, cyclically): an edit keeps this scan's shape, not just its class, when the first is clearly
larger (gate: :data:`IOU_RATIO` x).

The same figures for the training target itself (the source scan rendered in red ink: what a perfect
edit returns) are reported beside them as ``target_*``: the ratio no edit can beat on these scans. Measured
on the three seeds' held-out sources, it is 1.23-1.27 (IoU 0.89 with the source: red ink is lighter than
black, so its mask is thinner; 0.70-0.73 with another scan of the digit, since 8x8 scans of one digit
upscaled to 64 px overlap that much), under the issue's 1.5x.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .digits import INK_DARKNESS, RED_INK, render
from .lora import train_and_copy

INSTRUCTION = "make the ink red"
IOU_RATIO = 1.5


@dataclass
class EditSpec:
    """The edit LoRA's ``krea2 train`` settings and how many held-out scans per digit it edits."""

    steps: int
    learning_rate: float
    rank: int = 16
    batch_size: int = 8
    pairs: int = 300
    per_digit: int = 10
    guidance: float = 0.0
    """CFG scale of the edits (Krea convention, 0 = off)."""


def write_pairs(folder: Path, scans: np.ndarray, resolution: int) -> Path:
    """``folder/references/NAME.png`` (black ink) and ``folder/targets/NAME.png`` + ``NAME.txt`` (the same
    scan in red ink, :data:`INSTRUCTION`), one pair per (N, 8, 8) scan: the layout ``data.references`` reads."""
    from .digits import write_folder

    folder = Path(folder)
    write_folder(folder / "references", render(scans, resolution), ["" for _ in scans], prefix="pair_")
    for caption_file in (folder / "references").glob("*.txt"):
        caption_file.unlink()  # references carry no caption
    write_folder(folder / "targets", render(scans, resolution, RED_INK), [INSTRUCTION for _ in scans], prefix="pair_")
    return folder


def edit_config(spec: EditSpec, base_dir: Path, pairs: Path, run_dir: Path, resolution: int, seed: int) -> dict:
    """The ``krea2 train`` mapping: the pairs with their references (as vision tokens and as clean
    latents, the defaults), the steps / rate / rank / batch, a LoRA on the default targets plus the
    in/out projections of this narrow model; every other key at its default."""
    return {
        "output_dir": str(run_dir),
        "model": {"pretrained_model_name_or_path": str(base_dir)},
        "data": {"path": str(pairs), "references": {"max_pixels": resolution * resolution}, "resolution": resolution,
                 "caption_dropout": 0.0},
        "training": {"max_steps": spec.steps, "batch_size": spec.batch_size, "seed": seed},
        "lora": {"rank": spec.rank, "alpha": spec.rank, "extra_modules": ["img_in", "final_layer.linear"],
                 "train_text_fusion": False},  # the settings the edit stage was measured with
        "optimizer": {"learning_rate": spec.learning_rate},
        "checkpointing": {"every_n_steps": spec.steps, "keep_last": 1},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def train_edit_lora(spec: EditSpec, splits, base_dir: Path, work_dir: Path, out_file: Path, seed: int,
                    device: str = "cpu", log: Path | None = None) -> tuple[Path, float]:
    """Pairs from ``spec.pairs`` training scans (drawn with ``seed``), ``krea2 train``, the LoRA copied to
    ``out_file``. Returns (file, seconds)."""
    work_dir = Path(work_dir)
    pick = np.random.default_rng(seed).choice(len(splits.train_scans), min(spec.pairs, len(splits.train_scans)), replace=False)
    pairs = work_dir / "pairs"
    if not (pairs / "targets").is_dir():
        write_pairs(pairs, splits.train_scans[pick], splits.resolution)
    config = edit_config(spec, base_dir, pairs, work_dir / "run", splits.resolution, seed)
    result = train_and_copy(config, work_dir, out_file, spec.steps, device, log, config_name="edit.yaml")
    return result.lora_file, result.seconds


def heldout_sources(splits, per_digit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices into the held-out split: the first ``per_digit`` scans of each digit (digit-major), the
    other scan of the same digit each is compared with (the next of that digit, cyclically), and the digits."""
    sources, others, labels = [], [], []
    for digit in range(10):
        index = np.flatnonzero(np.asarray(splits.heldout_labels) == digit)
        for k in range(min(per_digit, len(index))):
            sources.append(index[k])
            others.append(index[(k + 1) % len(index)])
            labels.append(digit)
    return np.asarray(sources), np.asarray(others), np.asarray(labels, np.int64)


def sample_edits(pipe, sources: np.ndarray, steps: int, guidance: float, seed: int, resolution: int) -> np.ndarray:
    """One edit per uint8 (N, H, W, 3) source (its own pipeline call: references are per call), noise
    seed ``seed + i``. Returns uint8 (N, resolution, resolution, 3)."""
    import torch
    from PIL import Image

    out = []
    for i, source in enumerate(sources):
        with torch.inference_mode():
            image = pipe(prompt=INSTRUCTION, reference_images=[Image.fromarray(source)], height=resolution, width=resolution,
                         num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                         generator=torch.Generator(pipe.device).manual_seed(int(seed + i))).images[0]
        out.append(np.round(np.asarray(image, np.float32) * 255).clip(0, 255).astype(np.uint8))
    return np.stack(out)


def luminance_darkness(images: np.ndarray) -> np.ndarray:
    """float (N, H, W) in [0, 1]: how much darker than paper each pixel of uint8 (N, H, W, 3) images is, by
    the channels' mean (full red ink 0.66, black 1.0)."""
    return 1 - images.astype(np.float32).mean(axis=-1) / 255


def ink_mask(images: np.ndarray) -> np.ndarray:
    """bool (N, H, W): pixels at least :data:`proving.digits.INK_DARKNESS` darker than paper (any colour)."""
    return luminance_darkness(images) >= INK_DARKNESS


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float (N,): intersection over union of bool (N, H, W) masks (0 where both are empty)."""
    union = (a | b).sum(axis=(1, 2))
    return (a & b).sum(axis=(1, 2)) / np.maximum(union, 1)


def overlaps(outputs: np.ndarray, sources: np.ndarray, others: np.ndarray) -> dict:
    """{"iou_source", "iou_other", "iou_ratio"}: mean IoU of each output's ink mask with its source's and with
    the other scan's, and their ratio; uint8 (N, H, W, 3) arrays, aligned."""
    out = ink_mask(outputs)
    with_source, with_other = iou(out, ink_mask(sources)).mean(), iou(out, ink_mask(others)).mean()
    return {"iou_source": float(with_source), "iou_other": float(with_other),
            "iou_ratio": float(with_source / max(with_other, 1e-9))}


def measure(judge, outputs: np.ndarray, sources: np.ndarray, others: np.ndarray, labels: np.ndarray,
            targets: np.ndarray) -> dict:
    """The edit's figures: {"concept", "accuracy" (judge reads the source's digit), "iou_source",
    "iou_other", "iou_ratio", "n"} and the same overlaps of ``targets`` (each source scan in red ink, what
    a perfect edit returns) as "target_iou_source", "target_iou_other", "target_iou_ratio"; all arrays
    uint8 (N, H, W, 3), digit-major and aligned."""
    from .digits import shows_red_ink

    target = {f"target_{key}": value for key, value in overlaps(targets, sources, others).items()}
    return {"concept": float(shows_red_ink(outputs).mean()), "accuracy": judge.accuracy(outputs, labels),
            **overlaps(outputs, sources, others), **target, "n": int(len(labels))}
