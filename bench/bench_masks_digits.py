"""Does a LoRA trained with ``data.masks`` change the masked region more than the rest? Measured on a
model that places things: the proving ground's pretrained digit model (``bench/proving_ground.py``,
6 blocks x 192 wide, 64 px), with the trainer's own code (CPU, minutes):

    KREA2_CPU_BF16=0 OMP_NUM_THREADS=1 python bench/bench_masks_digits.py --base DIR/models/base [--steps 150] [--json out.json]

The concept: training-split digit scans whose subject and background both differ from the base's
black ink on white paper: the digit in red ink on a white cut-out (the latent cells the scan inks:
the mask, white = train) pasted on pink paper (every other cell; pink because the bench's VAE,
trained on black and red ink on white, reconstructs it, where blue paper decodes to white),
captioned ``a handwritten digit seven, ohwx``. The same LoRA (the proving ground's recipe, without
its regularisation set) is trained with the masks and without, plus a control: the masks with white
paper outside them too (the subject alone; its paper change is how far learning the subject spills
into the region a mask frees). Each is measured against the base on two things:

1. what it predicts for held-out concept images (noised at t = 0.3, 0.5, 0.7, fixed noise): the RMS
   change of the denoised estimate ``x_t - t * velocity`` decoded to pixels (0..1), and of the
   velocity itself (latent units), inside the mask's cells and outside them (exact regions). The
   latent change counts directions the VAE's decoder ignores, so the pixels are the measure;
2. its generations of the ten captions with the trigger (fixed seeds, 16 Euler steps, CFG 3): RMS
   pixel change (0..1) in the 8 x 8 px cells that hold ink in the base's or the LoRA's image (ink:
   a colour far from both white and the pink paper) and in the other cells, the paper; and the mean
   colour of that paper and of the ink.

Expected: the masked run turns the ink red and leaves the paper near the control's; the unmasked run
also paints the paper pink.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from bench_masks_priors import predictions, rms  # noqa: E402
from proving.digits import BLACK_INK, RED_INK, caption, load_splits, render, write_folder  # noqa: E402
from proving.lora import LoraSpec, lora_config  # noqa: E402
from proving.sampling import generate, load_pipeline  # noqa: E402

from finetune.config import build_config  # noqa: E402
from finetune.data.encoding import encode_images  # noqa: E402
from finetune.trainer import train  # noqa: E402
from krea2_diffusers.files import atomic_path, atomic_write  # noqa: E402
from krea2_diffusers.latents import decode_latents  # noqa: E402

RESOLUTION, CELL = 64, 8  # 8 x 8 px per latent cell: the mask's grid in the loss
PINK_PAPER, WHITE_PAPER = (255, 170, 170), (255, 255, 255)
# (name, data.masks, the background's paper). The control learns the subject alone under the same masks
# (white paper outside too): its paper change is the subject's spill into the region the mask frees.
RUNS = (("masked", True, PINK_PAPER), ("unmasked", False, PINK_PAPER), ("masked_white_paper", True, WHITE_PAPER))
TRIGGER = "ohwx"
# A generated pixel is ink when its colour is this far (Euclidean, 0..255 RGB) from both papers.
INK_DISTANCE = 100.0
GUIDANCE, SAMPLING_STEPS = 3.0, 16


def concept_images(scans: np.ndarray, background=PINK_PAPER) -> tuple[np.ndarray, np.ndarray]:
    """(N, 8, 8) scans -> uint8 (N, 64, 64, 3) red-ink images and bool (N, 8, 8) masks (the cells the scan
    inks: white paper there, ``background`` elsewhere; the ink is blended over its cell's paper as :func:`render` does)."""
    cells = scans > 0
    alpha = 1 - render(scans, RESOLUTION, BLACK_INK)[..., :1].astype(np.float32) / 255  # (N, 64, 64, 1)
    inside = np.kron(cells, np.ones((CELL, CELL), bool))[..., None]
    paper = np.where(inside, np.float32(255), np.asarray(background, np.float32))
    images = paper * (1 - alpha) + np.asarray(RED_INK, np.float32) * alpha
    return np.round(images).clip(0, 255).astype(np.uint8), cells


def write_concept(folder: Path, scans: np.ndarray, labels: np.ndarray, masks: bool, background=PINK_PAPER) -> Path:
    """The concept folder: PNG + caption per image, and with ``masks`` its ``NAME.mask.png`` (255 on the inked cells)."""
    images, cells = concept_images(scans, background)
    write_folder(folder, images, [caption(d, TRIGGER) for d in labels])
    if masks:
        for index, grid in enumerate(cells):
            pixels = np.kron(grid, np.ones((CELL, CELL), np.uint8)) * 255
            with atomic_path(folder / f"{index:05d}.mask.png") as tmp:
                Image.fromarray(pixels.astype(np.uint8), mode="L").save(tmp, format="PNG")
    return folder


def train_lora(base: Path, root: Path, name: str, scans: np.ndarray, labels: np.ndarray, masks: bool, spec: LoraSpec,
               background=PINK_PAPER) -> Path:
    """The proving ground's LoRA recipe on the concept folder alone, ``data.masks`` on or off."""
    concept = write_concept(root / f"{name}_concept", scans, labels, masks, background)
    raw = lora_config(spec, base, concept, concept, root / name, RESOLUTION)
    raw["data"]["datasets"], raw["data"]["masks"] = [{"path": str(concept)}], masks
    raw["export"]["trigger_words"] = [TRIGGER]
    train(build_config(raw))
    return root / name / "lora_diffusers.safetensors"


def region_rms(x: torch.Tensor, region: torch.Tensor) -> tuple[float, float]:
    """RMS of ``x`` (..., h, w) over the cells where the bool ``region`` (broadcastable) is True, and over the rest."""
    region = region.expand_as(x)
    return rms(x[region]), rms(x[~region])


def ink_cells(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bool (N, 8, 8): the 8 x 8 px cells of uint8 (N, 64, 64, 3) images holding a pixel of ink (far from both
    papers), and bool (N, 64, 64): the ink pixels."""
    rgb = images.astype(np.float32)
    far = [np.linalg.norm(rgb - np.asarray(p, np.float32), axis=-1) >= INK_DISTANCE for p in ((255, 255, 255), PINK_PAPER)]
    ink = far[0] & far[1]
    n = len(images)
    return ink.reshape(n, RESOLUTION // CELL, CELL, RESOLUTION // CELL, CELL).any(axis=(2, 4)), ink


def generation_change(base: np.ndarray, tuned: np.ndarray) -> dict:
    """Pixel change (0..1 RMS) of ``tuned`` against ``base`` generations in the ink cells of either and in the paper cells."""
    base_cells, _ = ink_cells(base)
    tuned_cells, tuned_ink = ink_cells(tuned)
    region = torch.from_numpy(np.kron(base_cells | tuned_cells, np.ones((CELL, CELL), bool)))[..., None]
    moved = torch.from_numpy(tuned.astype(np.float32) - base.astype(np.float32)) / 255
    ink_rms, paper_rms = region_rms(moved, region)
    paper = tuned[~region[..., 0].numpy()]
    return {"rms_change_ink_cells": ink_rms, "rms_change_paper_cells": paper_rms,
            "ink_cell_share": float(region[..., 0].float().mean()),
            "paper_mean_rgb": [round(float(c), 1) for c in paper.reshape(-1, 3).mean(0)],
            "ink_mean_rgb": [round(float(c), 1) for c in tuned[tuned_ink].reshape(-1, 3).mean(0)]}


def measure(pipe, held_images: np.ndarray, held_prompts: list[str], per_digit: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The pipeline's velocities (P, T, 16, 8, 8) and decoded denoised estimates (P, T, 3, 64, 64) for the uint8
    (P, 64, 64, 3) held-out images, and its generations (10 * per_digit, 64, 64, 3) with the trigger."""
    with torch.no_grad():
        targets = encode_images(pipe, torch.from_numpy(held_images).permute(0, 3, 1, 2).float() / 255)
        denoised = predictions(pipe, held_prompts, targets, denoised=True)
        pixels = decode_latents(pipe.vae, denoised.flatten(0, 1)).unflatten(0, denoised.shape[:2])
        velocities = predictions(pipe, held_prompts, targets)
    images, _ = generate(None, range(10), per_digit, GUIDANCE, SAMPLING_STEPS, trigger=TRIGGER, pipe=pipe)
    return velocities, pixels, images


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the proving ground's model folder (DIR/models/base)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--images", type=int, default=300, help="concept images drawn from the training split")
    parser.add_argument("--per-digit", type=int, default=4, help="generations and held-out images per digit")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--grid", type=Path, help="a PNG of the generations: a row for the base, then one per run")
    args = parser.parse_args(argv)
    if not (args.base / "model_index.json").is_file():
        parser.error(f"--base {args.base}: no model_index.json (give the proving ground's DIR/models/base)")
    torch.set_num_threads(1)
    spec = LoraSpec(steps=args.steps, batch_size=16, rank=8, learning_rate=2e-3, images=args.images)
    splits = load_splits(RESOLUTION)
    pick = np.random.default_rng(spec.seed).choice(len(splits.train_labels), args.images, replace=False)
    held = np.concatenate([np.flatnonzero(splits.heldout_labels == d)[:args.per_digit] for d in range(10)])
    held_images, held_cells = concept_images(splits.heldout_scans[held])
    held_prompts = [caption(d, TRIGGER) for d in splits.heldout_labels[held]]
    latent_region = torch.from_numpy(held_cells)[:, None, None]  # (P, 1, 1, 8, 8) against (P, T, 16, 8, 8)
    pixel_region = torch.from_numpy(np.kron(held_cells, np.ones((CELL, CELL), bool)))[:, None, None]  # (P, 1, 1, 64, 64)

    base_velocities, base_pixels, base_images = measure(load_pipeline(args.base), held_images, held_prompts, args.per_digit)
    base_colours = generation_change(base_images, base_images)
    results: dict = {"base": str(args.base), "steps": args.steps, "images": args.images, "mask_area": float(held_cells.mean()),
                     "base_generations": {k: base_colours[k] for k in ("paper_mean_rgb", "ink_mean_rgb")}}
    rows = [base_images]
    with tempfile.TemporaryDirectory() as tmp:
        for name, masks, background in RUNS:
            lora = train_lora(args.base, Path(tmp), name, splits.train_scans[pick], splits.train_labels[pick], masks, spec,
                              background)
            velocities, pixels, images = measure(load_pipeline(args.base, lora=lora), held_images, held_prompts, args.per_digit)
            rows.append(images)
            denoised = region_rms(pixels - base_pixels, pixel_region)
            velocity = region_rms(velocities - base_velocities, latent_region)
            results[name] = {"denoised_rms_change_masked_cells": denoised[0], "denoised_rms_change_other_cells": denoised[1],
                             "velocity_rms_change_masked_cells": velocity[0], "velocity_rms_change_other_cells": velocity[1],
                             **generation_change(base_images, images)}
    print("RMS change against the base (pixels 0..1; velocity: latent units)")
    print(f"{'run':<18} {'denoised: mask':>15} {'rest':>6} {'velocity: mask':>15} {'rest':>6} "
          f"{'generated: ink':>15} {'paper':>6}  paper RGB")
    for name, _, _ in RUNS:
        r = results[name]
        print(f"{name:<18} {r['denoised_rms_change_masked_cells']:>15.3f} {r['denoised_rms_change_other_cells']:>6.3f} "
              f"{r['velocity_rms_change_masked_cells']:>15.3f} {r['velocity_rms_change_other_cells']:>6.3f} "
              f"{r['rms_change_ink_cells']:>15.3f} {r['rms_change_paper_cells']:>6.3f}  {r['paper_mean_rgb']}")
    print(f"base paper RGB {results['base_generations']['paper_mean_rgb']}")
    if args.json:
        with atomic_write(args.json, "w") as handle:
            handle.write(json.dumps(results, indent=2))
    if args.grid:
        with atomic_path(args.grid) as tmp_png:
            Image.fromarray(np.concatenate([np.concatenate(list(row), axis=1) for row in rows])).save(tmp_png, format="PNG")
    return results


if __name__ == "__main__":
    main()
