"""Image features of the report: one pooled vector per image (the collector centres and
normalises them, :mod:`~finetune.report.collector`).

* ``qwen3vl`` (default): the pipeline's own Qwen3-VL vision tower, the one that reads reference
  images and captions; its merged patch tokens (the LLM-side vision embeddings) mean-pooled over
  each image. Nothing to download: every Krea 2 user holds it.
* ``pixels``: the image itself at :data:`PIXELS_SIZE` (flattened RGB): no model, layout and colour
  only; for tiny or random models (whose vision towers see noise) and tests.
* any other value: a ``transformers`` image model, a folder or hub id (DINOv2, SigLIP, CLIP ...):
  ``get_image_features`` when the model has it (CLIP / SigLIP), else its ``pooler_output``, else the
  mean of its last hidden states.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

QWEN3VL = "qwen3vl"
PIXELS = "pixels"
PIXELS_SIZE = 32
FEATURE_PIXELS = 384 * 384
"""Images are read at about this many pixels (aspect kept), as the pipeline reads reference images."""
BATCH = 16


class ImageFeatures(Protocol):
    name: str

    def __call__(self, images: Sequence) -> torch.Tensor:
        """PIL images -> (N, D) float32 pooled features, on the CPU."""


class Qwen3VLFeatures:
    """The vision tower of a ``Qwen3VLForConditionalGeneration`` (the pipeline's text encoder), on
    whatever device the encoder is when called."""

    name = QWEN3VL

    def __init__(self, text_encoder, max_pixels: int = FEATURE_PIXELS):
        from krea2_diffusers.conditioning.references import reference_image_processor

        self.text_encoder = text_encoder
        self.processor = reference_image_processor(text_encoder, max_pixels)

    @torch.no_grad()
    def __call__(self, images: Sequence) -> torch.Tensor:
        from krea2_diffusers.conditioning.references import vision_inputs
        from krea2_diffusers.conditioning.text import base_text_model

        model = base_text_model(self.text_encoder)
        device = next(model.parameters()).device
        pooled = []
        for start in range(0, len(images), BATCH):
            chunk = list(images[start:start + BATCH])
            pixels, grid, _ = vision_inputs(self.text_encoder, chunk, image_processor=self.processor)
            out = model.get_image_features(pixel_values=pixels.to(device), image_grid_thw=grid.to(device))
            # transformers 5: an output whose pooler_output holds one (tokens, D) tensor per image;
            # 4.x: a tuple (per-image embeddings, deepstack features).
            per_image = out.pooler_output if hasattr(out, "pooler_output") else out[0]
            pooled += [tokens.float().mean(0) for tokens in per_image]
        return torch.stack(pooled).cpu() if pooled else torch.zeros(0, 0)


class TransformersFeatures:
    """A ``transformers`` image model and its image processor, loaded from ``name`` on first use."""

    def __init__(self, name: str, device: torch.device | str = "cpu"):
        self.name = name
        self.device = torch.device(device)
        self.loaded = None  # (model, processor)

    def _load(self):
        if self.loaded is None:
            from transformers import AutoImageProcessor, AutoModel

            model = AutoModel.from_pretrained(self.name).to(self.device).eval()
            self.loaded = model, AutoImageProcessor.from_pretrained(self.name)
        return self.loaded

    @torch.no_grad()
    def __call__(self, images: Sequence) -> torch.Tensor:
        from krea2_diffusers.conditioning.references import to_rgb

        model, processor = self._load()
        pooled = []
        for start in range(0, len(images), BATCH):
            chunk = [to_rgb(image) for image in images[start:start + BATCH]]
            pixels = processor(images=chunk, return_tensors="pt")["pixel_values"].to(self.device)
            pooled.append(_pooled(model, pixels))
        return torch.cat(pooled).float().cpu() if pooled else torch.zeros(0, 0)


def _pooled(model, pixels: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, D): the model's image embedding (see the module docstring)."""
    if hasattr(model, "get_image_features"):
        out = model.get_image_features(pixel_values=pixels)
        return out if isinstance(out, torch.Tensor) else out.pooler_output
    out = model(pixel_values=pixels)
    pooler = getattr(out, "pooler_output", None)
    return pooler if pooler is not None else out.last_hidden_state.mean(1)


class PixelFeatures:
    """The pixels as features: (N, 3 * PIXELS_SIZE**2), each image area-resized."""

    name = PIXELS

    def __call__(self, images: Sequence) -> torch.Tensor:
        from .metrics import PIXEL_SIZE, to_pixels

        if not len(images):
            return torch.zeros(0, 0)
        return torch.nn.functional.avg_pool2d(to_pixels(images), PIXEL_SIZE // PIXELS_SIZE).flatten(1)


def load_features(name: str, text_encoder, device) -> ImageFeatures:
    """``validation.encoder``'s features: ``qwen3vl`` (needs the pipeline's text encoder), ``pixels``
    or a model name."""
    if name == QWEN3VL:
        return Qwen3VLFeatures(text_encoder)
    if name == PIXELS:
        return PixelFeatures()
    return TransformersFeatures(name, device)
