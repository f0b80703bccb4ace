"""Samples through the product's pipeline: ``Krea2Pipeline.from_pretrained`` on a stage's model folder
(optionally ``load_lora_weights``), prompts ``a handwritten digit seven`` ..., fixed seeds, then the
pinned sample files ``DIR/samples/<stage>/<digit>_<k>.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .digits import caption

# Sampled per pipeline call: enough to amortise the text encoder, small enough for CPU memory.
CHUNK = 50


def load_pipeline(model_dir: Path, device: str = "cpu", lora: Path | None = None):
    """The stage's pipeline in the project's compute dtype for ``device`` (policy: bf16 on CUDA and on
    CPUs with bf16 units), with ``lora`` loaded if given."""
    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.precision import compute_dtype

    # The folder's tokenizer is parsed once per process (Krea2Pipeline.from_pretrained; every stage's is the same).
    pipe = Krea2Pipeline.from_pretrained(str(model_dir), dtype=compute_dtype(device)).to(device)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def generate(model_dir: Path, digits, per_digit: int, guidance: float, steps: int, seed: int = 0, lora: Path | None = None,
             trigger: str | None = None, device: str = "cpu", resolution: int = 64, pipe=None) -> tuple[np.ndarray, np.ndarray]:
    """``per_digit`` images of each digit in ``digits`` -> uint8 (N, resolution, resolution, 3) and int64
    labels (N,), digit-major. Sample ``k`` of digit ``d`` starts from the noise of seed
    ``seed + 1000 * d + k``, so stages sampled with the same seed share their starting noise.
    ``pipe``: an already loaded pipeline (then ``model_dir``/``lora`` are not read)."""
    import torch

    pipe = pipe if pipe is not None else load_pipeline(model_dir, device, lora)
    labels = np.repeat(np.asarray(list(digits), np.int64), per_digit)
    ks = np.tile(np.arange(per_digit), len(list(digits)))
    out = []
    for start in range(0, len(labels), CHUNK):
        part = range(start, min(start + CHUNK, len(labels)))
        prompts = [caption(labels[i], trigger) for i in part]
        generators = [torch.Generator(device).manual_seed(int(seed + 1000 * labels[i] + ks[i])) for i in part]
        with torch.inference_mode():
            images = pipe(prompt=prompts, height=resolution, width=resolution, num_inference_steps=steps,
                          guidance_scale=guidance, generator=generators, output_type="np").images
        out.append(np.round(np.asarray(images, np.float32) * 255).clip(0, 255).astype(np.uint8))
    return np.concatenate(out), labels


def save_samples(out_dir: Path, stage: str, images: np.ndarray, labels: np.ndarray) -> Path:
    """``out_dir/samples/<stage>/<digit>_<k>.png`` (k counts within each digit); returns the folder."""
    from PIL import Image

    from krea2_diffusers.files import atomic_path

    folder = Path(out_dir) / "samples" / stage
    folder.mkdir(parents=True, exist_ok=True)
    counts: dict[int, int] = {}
    for image, label in zip(images, labels):
        k = counts.get(int(label), 0)
        counts[int(label)] = k + 1
        with atomic_path(folder / f"{int(label)}_{k}.png") as tmp:
            Image.fromarray(image).save(tmp, format="PNG")
    return folder
