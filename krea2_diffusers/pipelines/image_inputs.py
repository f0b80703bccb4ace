"""Input images and masks for image-to-image and inpainting: loading, sizing, latent masks, crops.

Conventions follow diffusers: pixel tensors (B, 3, H, W) in [0, 1]; masks are white (>= 0.5) where
the image is repainted and black where it is kept.
"""

from __future__ import annotations

import logging

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from ..conditioning.references import load_reference_images
from ..latents import VAE_SCALE_FACTOR, pack_latents

logger = logging.getLogger(__name__)

# Masks are binarised: a pixel at or above half intensity is repainted.
MASK_THRESHOLD = 0.5
_UINT8_MAX = 255.0


def load_images(images, what: str, gray: bool = False) -> list[PIL.Image.Image]:
    """One image or a list (paths, PIL, arrays, tensors; see ``conditioning.references.load_reference_images``)."""
    loaded = load_reference_images(images, what=what, gray=gray)
    if not loaded:
        raise ValueError(f"{what} is required")
    return loaded


def fit(images: list[PIL.Image.Image], height: int, width: int, what: str, resample=PIL.Image.LANCZOS) -> list[PIL.Image.Image]:
    """Resize images that are not ``width`` x ``height`` to it, with a warning (diffusers' behaviour)."""
    out = []
    for image in images:
        if image.size != (width, height):
            logger.warning("%s is %dx%d, the target is %dx%d: resizing it", what, image.width, image.height, width, height)
            image = image.resize((width, height), resample)
        out.append(image)
    return out


def to_pixels(images: list[PIL.Image.Image]) -> torch.Tensor:
    """PIL images of one size -> (B, C, H, W) float32 in [0, 1] (C = 3 for RGB, 1 for L)."""
    arrays = [np.asarray(image, dtype=np.float32) / _UINT8_MAX for image in images]
    tensor = torch.from_numpy(np.stack(arrays))
    return (tensor[:, None] if tensor.ndim == 3 else tensor.permute(0, 3, 1, 2)).contiguous()


def latent_repaint_mask(pixel_mask: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, 1, H, W) pixel mask in [0, 1] -> (B, N, channels * 4) bool over the packed latents.

    A latent cell is repainted when ANY of its 8x8 pixels is (after binarising at 0.5), so every
    white pixel is repainted; every other latent equals the input image's exactly.
    """
    binary = (pixel_mask >= MASK_THRESHOLD).float()
    cells = F.max_pool2d(binary, VAE_SCALE_FACTOR) > 0
    return pack_latents(cells.expand(-1, channels, -1, -1).contiguous().float()) > 0


def crop_region(mask: PIL.Image.Image, width: int, height: int, pad: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom): the mask's white area grown by ``pad`` pixels, then widened to the
    target's aspect ratio (``width / height``), inside the image. The whole image if nothing is white."""
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"padding_mask_crop must be a non-negative integer (pixels), got {pad!r}")
    white = np.asarray(mask) >= MASK_THRESHOLD * _UINT8_MAX
    full_w, full_h = mask.size
    rows, cols = np.flatnonzero(white.any(1)), np.flatnonzero(white.any(0))
    if not len(rows):
        return 0, 0, full_w, full_h
    left, right = max(int(cols[0]) - pad, 0), min(int(cols[-1]) + 1 + pad, full_w)
    top, bottom = max(int(rows[0]) - pad, 0), min(int(rows[-1]) + 1 + pad, full_h)
    box_w, box_h = right - left, bottom - top
    ratio = width / height
    if box_w / box_h < ratio:
        box_w = min(full_w, round(box_h * ratio))
    else:
        box_h = min(full_h, round(box_w / ratio))
    centre_x, centre_y = (left + right) / 2, (top + bottom) / 2
    left = int(min(max(round(centre_x - box_w / 2), 0), full_w - box_w))
    top = int(min(max(round(centre_y - box_h / 2), 0), full_h - box_h))
    return left, top, left + box_w, top + box_h


def overlay(generated: torch.Tensor, originals: list[PIL.Image.Image], masks: list[PIL.Image.Image],
            box: tuple[int, int, int, int]) -> torch.Tensor:
    """Paste generated crops (B, 3, h, w) in [0, 1] back into the original images inside ``box``,
    only where the (original-size) mask is white. Returns (B, 3, H0, W0) in [0, 1]."""
    left, top, right, bottom = box
    out = []
    for index, image in enumerate(generated):
        original = originals[min(index, len(originals) - 1)]
        mask = masks[min(index, len(masks) - 1)].point(lambda v: 255 if v >= MASK_THRESHOLD * _UINT8_MAX else 0)
        array = (image.permute(1, 2, 0).clamp(0, 1).cpu().numpy() * _UINT8_MAX).round().astype(np.uint8)
        crop = PIL.Image.fromarray(array).resize((right - left, bottom - top), PIL.Image.LANCZOS)
        pasted = original.copy()
        pasted.paste(crop, (left, top))
        out.append(PIL.Image.composite(pasted, original, mask))
    return to_pixels(out)
