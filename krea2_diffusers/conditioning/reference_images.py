"""General reference images (edit, identity, insertion LoRAs): input checks, sizes, conditioning.

A reference image enters the model by two paths, each switchable:

* **vision tokens**: the image inside the Qwen3-VL prompt (``<|vision_start|><|image_pad|>...``
  before the prompt in the Krea 2 template, :func:`~krea2_diffusers.conditioning.references.encode_prompt_with_images`);
* **reference latents**: its clean VAE latents after the target's tokens, reference k (from 1) at
  RoPE (k, i, j), modulated as timestep 0 (``reference_method="index_timestep_zero"``, ComfyUI's
  native Krea 2 with ``ReferenceLatent``) or with the step's timestep (``"index"``).

This is the style-reference mechanism (:func:`~krea2_diffusers.conditioning.style.reference_batch`)
with another sizing: every reference keeps its own aspect and its own size, downscaled only when
it holds more than ``max_pixels`` (the training key ``data.references.max_pixels``), instead of
sharing one area with the others. Training (``finetune``) sizes references with :func:`edit_reference_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import PIL.Image

from ..latents import PIXELS_PER_TOKEN
from .references import REFERENCE_MAX_PIXELS, check_style_inputs, load_reference_images
from .style import StyleBatch, reference_batch

# Edit LoRAs are trained with 1-3 references (``data.references.max_references``); more are refused
# at inference too: the reference index k of RoPE (k, i, j) beyond the trained ones is unseen.
MAX_REFERENCE_IMAGES = 3
# Pixels each reference's latents may hold (1024^2, the training default): 4096 tokens at most.
DEFAULT_REFERENCE_MAX_PIXELS = 1024 * 1024
# Pixels each reference gets as vision tokens: 384^2 (144 Qwen3-VL tokens), as style references.
VISION_MAX_PIXELS = REFERENCE_MAX_PIXELS


@dataclass
class ReferenceImages:
    """Checked reference images: RGB PIL images, one strength each (> 0; zero ones are dropped),
    the two entry paths and the latents' pixel budget."""

    images: list[PIL.Image.Image]
    strengths: list[float]
    vision_tokens: bool
    latents: bool
    max_pixels: int

    def sizes(self) -> list[tuple[int, int]]:
        """(h, w) in pixels each reference's latents are encoded at."""
        return [edit_reference_size(image.width, image.height, self.max_pixels) for image in self.images]


def edit_reference_size(width: int, height: int, max_pixels: int = DEFAULT_REFERENCE_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) of a reference's latents: its own aspect, downscaled (never up) to at most
    ``max_pixels``, each side rounded down to a multiple of 16 (at least 16)."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    side = lambda pixels: max(PIXELS_PER_TOKEN, int(pixels * scale) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
    return side(height), side(width)


def check_max_pixels(max_pixels, name: str = "reference_max_pixels") -> int:
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < PIXELS_PER_TOKEN**2:
        raise ValueError(f"{name} must be an integer >= {PIXELS_PER_TOKEN**2} (one 16x16 token), got {max_pixels!r}")
    return max_pixels


def check_reference_images(reference_images, reference_strengths=None, *, vision_tokens: bool = True,
                           latents: bool = True, max_pixels: int = DEFAULT_REFERENCE_MAX_PIXELS,
                           max_references: int = MAX_REFERENCE_IMAGES) -> ReferenceImages | None:
    """Validate and read reference images before any model work.

    Args:
        reference_images: None, one image, or a list (paths, PIL images, arrays, tensors: see
            :func:`~krea2_diffusers.conditioning.references.load_reference_images`).
        reference_strengths: None (1 each), one number for all, or one per image; >= 0 (0 drops it).
    Returns:
        the references to use, or None when there are none (or all have strength 0).
    Raises:
        ValueError: more than ``max_references`` images, a file that is not an image (naming it),
            bad strengths, both paths switched off, a bad ``max_pixels``.
    """
    strengths = check_style_inputs(reference_images, reference_strengths, max_references=max_references, what="reference")
    if not strengths:
        return None
    if not (vision_tokens or latents):
        raise ValueError("reference_vision_tokens and reference_latents are both False: the reference images would not "
                         "reach the model; switch at least one on")
    max_pixels = check_max_pixels(max_pixels)
    images = load_reference_images(reference_images, what="reference image")
    kept = [(image, s) for image, s in zip(images, strengths) if s > 0]
    if not kept:
        return None
    return ReferenceImages([i for i, _ in kept], [s for _, s in kept], bool(vision_tokens), bool(latents), max_pixels)


def reference_image_batch(pipe, texts: list[str], references: ReferenceImages, *, max_sequence_length: int,
                          device) -> StyleBatch:
    """Conditioning of ``texts`` (all rows: prompts then negatives) with ``references``: embeds
    (B, L, layers, Dt) with the vision tokens, packed latents (B, R, 64) at positions (R, 3)."""
    return reference_batch(pipe, texts, references.images, references.strengths,
                           sizes=references.sizes() if references.latents else None,
                           vision_max_pixels=VISION_MAX_PIXELS if references.vision_tokens else None,
                           max_sequence_length=max_sequence_length, device=device)
