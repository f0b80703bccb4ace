"""Weighted style references: turn reference images into extra conditioning for one generation.

Two modes:

* ``"reference"`` (the community workflow): each image enters the text encoder as vision tokens
  before the prompt, and its VAE latents join the sequence after the target tokens at RoPE
  position (k, i, j), modulated as timestep 0. Needs a style-reference LoRA to be meaningful.
* ``"describe"`` (training-free): the VLM writes a content-free style description of each image
  (cached per image) and each description enters as its own group of text tokens.

In both, a reference's strength s becomes an additive ``log(s)`` bias on the attention logits of
its tokens (as keys) in every attention layer: s = 1 is the plain mechanism, s -> 0 removes the
reference (s = 0 references are dropped outright, so that removal is exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..latents import encode_images, pack_latents, position_ids, PIXELS_PER_TOKEN
from .references import REFERENCE_MAX_PIXELS, REFERENCE_MIN_PIXELS
from .text import encode_prompts, pad_conditioning

STYLE_MODES = ("reference", "describe")
# Side in pixels of the area all reference latents of a generation share (512^2 px = 1024 tokens).
DEFAULT_STYLE_RESOLUTION = 512


@dataclass
class StyleBatch:
    """Text and reference inputs of a style-referenced generation, for every row of the batch.

    embeds (B, L, layers, Dt), mask (B, L); groups[k]: [start, end) ranges of reference k's tokens
    in the text; latents (B, R, 64) packed references (or None); latent_groups[k]: ranges in R;
    positions (R, 3) RoPE coordinates of the reference tokens.
    """

    embeds: torch.Tensor
    mask: torch.Tensor
    strengths: list[float]
    groups: list[list[tuple[int, int]]] = field(default_factory=list)
    latents: torch.Tensor | None = None
    latent_groups: list[tuple[int, int]] = field(default_factory=list)
    positions: torch.Tensor | None = None

    @property
    def reference_len(self) -> int:
        return 0 if self.latents is None else self.latents.shape[1]

    def key_bias(self, image_len: int) -> torch.Tensor | None:
        """(B, L + N + R) float: log(s_k) on reference k's keys, 0 elsewhere; None if all s = 1."""
        if all(s == 1.0 for s in self.strengths):
            return None
        batch, text_len = self.mask.shape
        bias = strength_bias(self.strengths, self.groups, self.latent_groups, text_len, image_len, self.reference_len)
        return bias.expand(batch, -1)


def strength_bias(strengths: list[float], text_groups: list[list[tuple[int, int]]], latent_groups: list[tuple[int, int]],
                  text_len: int, image_len: int, reference_len: int) -> torch.Tensor:
    """(L + N + R,) float: log(s_k) on reference k's text tokens (``text_groups[k]``, ranges in L)
    and latent tokens (``latent_groups[k]``, ranges in R), 0 elsewhere. Strengths must be > 0."""
    bias = torch.zeros(text_len + image_len + reference_len)
    offset = text_len + image_len
    for k, strength in enumerate(strengths):
        log_s = math.log(strength)
        for start, end in text_groups[k] if k < len(text_groups) else ():
            bias[start:end] = log_s
        if k < len(latent_groups):
            start, end = latent_groups[k]
            bias[offset + start: offset + end] = log_s
    return bias


def reference_area(height: int, width: int, count: int, style_resolution: int | None) -> float:
    """Pixel area each of ``count`` references is encoded at.

    ``style_resolution`` None: the target's area each (the community workflow: R grows with the
    count). Otherwise all references SHARE ``min(target area, style_resolution^2)``, so the
    reference tokens of one generation never exceed one bounded budget (1024 tokens at 512).
    """
    if style_resolution is None:
        return float(height * width)
    if isinstance(style_resolution, bool) or not isinstance(style_resolution, int) or style_resolution < PIXELS_PER_TOKEN:
        raise ValueError(f"style_resolution must be None or an integer >= {PIXELS_PER_TOKEN} (pixels), got {style_resolution!r}")
    return min(height * width, style_resolution**2) / count


def reference_size(image, area: float) -> tuple[int, int]:
    """(height, width) of a reference encoded at about ``area`` pixels: its own aspect, multiples of
    16 rounded down (at least one token), so the budget is never exceeded."""
    scale = math.sqrt(area / (image.width * image.height))
    side = lambda pixels: max(PIXELS_PER_TOKEN, int(pixels * scale) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
    return side(image.height), side(image.width)


def vision_pixels(count: int, style_resolution: int | None) -> int:
    """Pixels each reference gets in the VLM: 384^2 each, or 384^2 shared when the budget is bounded."""
    if style_resolution is None:
        return REFERENCE_MAX_PIXELS
    return max(REFERENCE_MIN_PIXELS, REFERENCE_MAX_PIXELS // count)


def moodboard_image(images, side: int):
    """A moodboard as ONE reference: the images tiled into a ``side`` x ``side`` board.

    Grid of ``ceil(sqrt(n))`` columns and as many rows as needed; every image is scaled to cover its
    cell and centre-cropped (no distortion); unused cells stay white. The board's size does not
    depend on n, so a moodboard of 2 or of 32 images costs the same.
    """
    import PIL.Image
    import PIL.ImageOps

    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    board = PIL.Image.new("RGB", (side, side), (255, 255, 255))
    for index, image in enumerate(images):
        row, column = divmod(index, columns)
        left, top = column * side // columns, row * side // rows
        right, bottom = (column + 1) * side // columns, (row + 1) * side // rows
        board.paste(PIL.ImageOps.fit(image.convert("RGB"), (right - left, bottom - top)), (left, top))
    return board


def moodboard_side(height: int, width: int, style_resolution: int | None) -> int:
    """The board's side: the reference budget's (or the target's area when unbounded), multiple of 16."""
    area = reference_area(height, width, 1, style_resolution)
    return max(PIXELS_PER_TOKEN, int(math.sqrt(area)) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)


def encode_reference_latents(vae, images, sizes: list[tuple[int, int]], device) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor]:
    """VAE-encode references resized to pixel ``sizes`` (h, w) (multiples of 16): packed latents
    (1, R, 64), per-reference ranges in R, positions (R, 3) at (k, i, j)."""
    import numpy as np

    packed = []
    for image, (h, w) in zip(images, sizes):
        pixels = torch.from_numpy(np.asarray(image.convert("RGB").resize((w, h)), dtype=np.float32) / 255.0)
        latents = encode_images(vae, pixels.permute(2, 0, 1)[None].to(device))
        packed.append(pack_latents(latents.float()))
    groups, positions = reference_layout(sizes, device)
    return torch.cat(packed, 1), groups, positions


def reference_layout(sizes: list[tuple[int, int]], device=None) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Where references of pixel ``sizes`` (h, w) sit after the target: each one's [start, end) token
    range in R, and positions (R, 3): reference k (from 1) at RoPE (k, i, j)."""
    groups, positions, start = [], [], 0
    for k, (h, w) in enumerate(sizes, start=1):
        grid_h, grid_w = h // PIXELS_PER_TOKEN, w // PIXELS_PER_TOKEN
        groups.append((start, start + grid_h * grid_w))
        start += grid_h * grid_w
        positions.append(position_ids(0, grid_h, grid_w, device, first_axis=k))
    return groups, torch.cat(positions)


def _reference_text(pipe, texts, images, max_sequence_length, device, max_pixels):
    """Every text encoded with the images as vision tokens; groups are the same for every row."""
    from .references import encode_prompt_with_images

    embeds, masks, groups = [], [], None
    for text in texts:
        e, m, g = encode_prompt_with_images(pipe.text_encoder, pipe.tokenizer, text, images,
                                            layers=pipe.config.text_encoder_select_layers, max_sequence_length=max_sequence_length,
                                            max_pixels=max_pixels)
        embeds.append(e.to(device))
        masks.append(m.to(device))
        groups = [[tuple(r)] for r in g]
    embeds, mask = pad_conditioning(embeds, masks)
    return embeds, mask, groups


def _described_text(pipe, texts, images, max_sequence_length, device, cache, seed):
    """[prompt | description 1 | description 2 ...] token groups, the same offsets in every row."""
    descriptions = [cache.describe(pipe.language_model(), pipe.tokenizer, image, seed=seed) for image in images]
    layers = pipe.config.text_encoder_select_layers
    embeds, mask = encode_prompts(pipe.text_encoder, pipe.tokenizer, list(texts), layers=layers, max_sequence_length=max_sequence_length, device=device)
    parts, masks, groups = [embeds], [mask], []
    offset = embeds.shape[1]
    for description in descriptions:
        d_embeds, d_mask = encode_prompts(pipe.text_encoder, pipe.tokenizer, [description], layers=layers, max_sequence_length=max_sequence_length, device=device)
        parts.append(d_embeds.expand(len(texts), -1, -1, -1))
        masks.append(d_mask.expand(len(texts), -1))
        groups.append([(offset, offset + d_embeds.shape[1])])
        offset += d_embeds.shape[1]
    return torch.cat(parts, 1), torch.cat(masks, 1), groups, descriptions


def prepare_style_batch(pipe, texts: list[str], images, strengths: list[float], *, mode: str, height: int, width: int,
                        max_sequence_length: int, device, cache=None, seed: int = 0,
                        style_resolution: int | None = DEFAULT_STYLE_RESOLUTION) -> StyleBatch:
    """Conditioning for ``texts`` (all rows: prompts then negatives) with the given references.

    References of strength 0 must already be removed by the caller. ``style_resolution`` bounds
    the reference latents (:func:`reference_area`) and shares the VLM's pixels (:func:`vision_pixels`).
    """
    if mode not in STYLE_MODES:
        raise ValueError(f"style_mode must be one of {STYLE_MODES}, got {mode!r}")
    if mode == "reference":
        area = reference_area(height, width, len(images), style_resolution)
        return reference_batch(pipe, texts, images, strengths, sizes=[reference_size(image, area) for image in images],
                               vision_max_pixels=vision_pixels(len(images), style_resolution),
                               max_sequence_length=max_sequence_length, device=device)
    embeds, mask, groups, _ = _described_text(pipe, texts, images, max_sequence_length, device, cache, seed)
    return StyleBatch(embeds, mask, strengths, groups)


def reference_batch(pipe, texts: list[str], images, strengths: list[float], *, sizes: list[tuple[int, int]] | None,
                    vision_max_pixels: int | None, max_sequence_length: int, device) -> StyleBatch:
    """The one reference mechanism (style references and general reference images alike).

    Args:
        texts: every row's text (prompts then negatives).
        images: RGB PIL references, strengths > 0 each.
        sizes: pixel (h, w) each reference's latents are encoded at (multiples of 16); None: no
            reference latents (text only).
        vision_max_pixels: pixels each image gets as vision tokens in the text encoder; None: plain
            text (no vision tokens).
    """
    if vision_max_pixels is None:
        layers = pipe.config.text_encoder_select_layers
        embeds, mask = encode_prompts(pipe.text_encoder, pipe.tokenizer, list(texts), layers=layers,
                                      max_sequence_length=max_sequence_length, device=device)
        groups = []
    else:
        embeds, mask, groups = _reference_text(pipe, texts, images, max_sequence_length, device, vision_max_pixels)
    if sizes is None:
        return StyleBatch(embeds, mask, strengths, groups)
    latents, latent_groups, positions = encode_reference_latents(pipe.vae, images, sizes, device)
    return StyleBatch(embeds, mask, strengths, groups, latents.expand(len(texts), -1, -1), latent_groups, positions)


def style_image_batch(pipe, prompts, negatives, style_images, style_strengths, *, mode: str, moodboard: bool, height: int,
                      width: int, max_sequence_length: int, device, cache, style_resolution: int | None) -> StyleBatch | None:
    """The pipeline's ``style_images``: the style-referenced text (prompts then negatives) and
    reference inputs, or None (no images, or all at strength 0: exactly the plain generation)."""
    from .references import check_style_inputs, load_reference_images

    # Checked before any model work; strengths come back one per image (one for a moodboard).
    strengths = check_style_inputs(style_images, style_strengths, moodboard=moodboard)
    if not strengths:
        return None
    if prompts is None:
        raise ValueError("style_images need `prompt` text, not prompt_embeds")
    images = load_reference_images(style_images)
    if moodboard:  # one board image: the same tokens (and cost) for any number of images
        images = [moodboard_image(images, moodboard_side(height, width, style_resolution))]
    kept = [(image, s) for image, s in zip(images, strengths) if s > 0]
    if not kept:
        return None
    return prepare_style_batch(pipe, prompts + (negatives or []), [i for i, _ in kept], [s for _, s in kept], mode=mode,
                               height=height, width=width, max_sequence_length=max_sequence_length, device=device,
                               cache=cache, style_resolution=style_resolution)
