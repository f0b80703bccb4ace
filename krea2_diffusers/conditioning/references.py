"""Style references: input checks, and the text encoder's (VLM's) side of the reference mechanism.

Two ways for a reference image to reach the model:

* **Vision tokens** (compatible with ComfyUI's official style-reference template): each image enters
  the Qwen3-VL text encoder as ``<|vision_start|><|image_pad|>...<|vision_end|>`` placed before the
  prompt inside the usual Krea 2 system template (:func:`encode_prompt_with_images`). The
  transformer-side half (reference latents at RoPE (k, i, j), timestep-zero modulation, a style LoRA)
  lives in the pipeline.
* **Training-free descriptions**: with no style LoRA at hand, the VLM writes a content-free style
  description of each reference (``krea2_diffusers.conditioning.descriptions``: ``describe_style``, cached per
  image by ``StyleDescriptionCache``), and each description enters as its own group of text tokens
  (assembled in ``krea2_diffusers.conditioning.style``).

Either way every reference k gets a token range ``groups[k]`` so that the pipeline can weight it by
its strength s (an additive ``log(s)`` bias on those tokens as attention keys).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import PIL.Image
import torch

from ..files import split_path_and_number
from .text import (
    ASSISTANT_SUFFIX, DEFAULT_MAX_SEQUENCE_LENGTH, SYSTEM_PREFIX, TAPPED_LAYERS, base_text_model, template_counts,
)

logger = logging.getLogger(__name__)

# Krea's hosted API takes up to 10 image style references, each with its own strength.
MAX_STYLE_REFERENCES = 10
DEFAULT_STYLE_STRENGTH = 1.0
# A moodboard is many images read together as ONE direction: they are tiled into one board image of
# one reference's budget (``style.moodboard_image``), weighted by one strength, so a 20-image board at
# 0.35 pulls like one reference at 0.35 and costs the same as a 2-image board; 0.35 is the hosted
# API's moodboard default. The cap keeps every image's cell on the board at least ~85 px at 512.
MAX_MOODBOARD_IMAGES = 32
DEFAULT_MOODBOARD_STRENGTH = 0.35

# Qwen3-VL's image preprocessing (its released preprocessor config): mean/std 0.5, patch 16, merge 2.
QWEN3_VL_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_IMAGE_STD = (0.5, 0.5, 0.5)
# Reference images are read for style, not detail: ~384^2 pixels gives 144 vision tokens per image with
# Qwen3-VL (32 px per merged token), which keeps 10 references at ~1.4k extra text tokens per step.
REFERENCE_MAX_PIXELS = 384 * 384
REFERENCE_MIN_PIXELS = 64 * 64

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"

# Pixel values of float arrays must lie in [0, 1]; allow float rounding just outside.
_FLOAT_RANGE_TOLERANCE = 1e-3
_UINT8_MAX = 255
# Images are composited onto white where transparent: RGBA -> RGB otherwise exposes undefined colours.
_BACKGROUND = (255, 255, 255)


# ---------------------------------------------------------------------------------------------- inputs
def _array_to_image(array: np.ndarray, name: str) -> list[PIL.Image.Image]:
    """(H, W), (H, W, C), (C, H, W) or a batch (B, ...) of uint8 / float [0, 1] pixels -> PIL images."""
    if array.ndim == 4:
        return [image for item in array for image in _array_to_image(item, name)]
    if array.ndim == 3 and array.shape[-1] not in (1, 3, 4) and array.shape[0] in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)  # CHW (torch layout) -> HWC
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(f"{name}: expected an image array (H, W), (H, W, C) or (C, H, W) with C in 1/3/4, got shape {array.shape}")
    if np.issubdtype(array.dtype, np.floating):
        lo, hi = float(np.nanmin(array)), float(np.nanmax(array))
        if not np.isfinite(array).all() or lo < -_FLOAT_RANGE_TOLERANCE or hi > 1 + _FLOAT_RANGE_TOLERANCE:
            raise ValueError(f"{name}: float pixels must lie in [0, 1], got range [{lo:.3g}, {hi:.3g}]")
        array = (np.clip(array, 0.0, 1.0) * _UINT8_MAX).round().astype(np.uint8)
    elif array.dtype == np.bool_:
        array = array.astype(np.uint8) * _UINT8_MAX
    elif np.issubdtype(array.dtype, np.integer):
        if array.min() < 0 or array.max() > _UINT8_MAX:
            raise ValueError(f"{name}: integer pixels must lie in [0, 255], got range [{array.min()}, {array.max()}]")
        array = array.astype(np.uint8)
    else:
        raise ValueError(f"{name}: unsupported pixel dtype {array.dtype}")
    return [PIL.Image.fromarray(np.ascontiguousarray(array))]


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """An RGB copy of ``image``; transparency is composited onto white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGB", rgba.size, _BACKGROUND)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def to_gray(image: PIL.Image.Image, what: str = "mask") -> PIL.Image.Image:
    """A single-channel (L) copy of ``image``; other modes are converted (luminance) with a warning."""
    if image.mode == "L":
        return image
    if image.mode not in ("1", "I", "I;16", "F"):
        logger.warning("%s has %d channels (%s); converting it to one channel (luminance)", what, len(image.getbands()), image.mode)
    return image.convert("L")


def load_reference_images(images, what: str = "style image", gray: bool = False) -> list[PIL.Image.Image]:
    """Load images as RGB (or, with ``gray``, single-channel L) PIL images.

    Args:
        images: one item or a list of items, each a file path, a PIL image, a numpy array or a torch
            tensor ((H, W), (H, W, C), (C, H, W), or a batch (B, ...) that yields B images; uint8 or
            float in [0, 1]; ComfyUI IMAGE tensors (B, H, W, C) work as they are).
        what: how errors and warnings name the images ("style image", "mask_image" ...).
    Raises:
        ValueError: an unreadable / missing file (naming it) or an unusable array.
    """
    if images is None:
        return []
    convert = (lambda image: to_gray(image, what)) if gray else to_rgb
    items = [images] if isinstance(images, (str, os.PathLike, PIL.Image.Image, np.ndarray, torch.Tensor)) else list(images)
    loaded: list[PIL.Image.Image] = []
    for index, item in enumerate(items):
        name = f"{what} {index}"
        if isinstance(item, (str, os.PathLike)):
            path = Path(item)
            try:
                with PIL.Image.open(path) as opened:
                    opened.load()  # read now: a truncated file must fail here, not later inside the model
                    loaded.append(convert(opened).copy())
            except FileNotFoundError:
                raise ValueError(f"cannot read {what} {str(path)!r}: no such file") from None
            except (OSError, PIL.UnidentifiedImageError, PIL.Image.DecompressionBombError, ValueError) as err:
                raise ValueError(f"cannot read {what} {str(path)!r}: {err}") from None
        elif isinstance(item, PIL.Image.Image):
            loaded.append(convert(item))
        elif isinstance(item, torch.Tensor):
            tensor = item.detach().cpu()
            array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
            loaded.extend(convert(image) for image in _array_to_image(array, name))
        elif isinstance(item, np.ndarray):
            loaded.extend(convert(image) for image in _array_to_image(item, name))
        else:
            raise ValueError(f"{name}: expected a path, PIL image, numpy array or torch tensor, got {type(item).__name__}")
    for index, image in enumerate(loaded):
        if image.width < 1 or image.height < 1:
            raise ValueError(f"{what} {index} is empty ({image.width}x{image.height})")
    return loaded


def one_image(image) -> PIL.Image.Image:
    images = load_reference_images([image])
    if len(images) != 1:
        raise ValueError(f"expected one image, got a batch of {len(images)}")
    return images[0]


def _count_images(style_images) -> int:
    """How many images ``style_images`` holds, without decoding files (a 4-D array is a batch)."""
    if style_images is None:
        return 0
    if isinstance(style_images, (str, os.PathLike, PIL.Image.Image)):
        return 1
    if isinstance(style_images, (np.ndarray, torch.Tensor)):
        return int(style_images.shape[0]) if style_images.ndim == 4 else 1
    return sum(_count_images(item) if isinstance(item, (np.ndarray, torch.Tensor)) else 1 for item in style_images)


def _check_strength(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0 (0 removes the reference), got {value!r}")
    return value


def check_style_inputs(style_images, style_strengths=None, max_references: int = MAX_STYLE_REFERENCES,
                       moodboard: bool = False, what: str = "style") -> list[float]:
    """Validate style references before any model work; return one strength per image.

    Args:
        style_images: paths / PIL images / arrays (see :func:`load_reference_images`) or None.
        style_strengths: per-image strengths >= 0 (None: 1.0 each; a single number applies to all).
            s = 1 is the unweighted mechanism, s = 0 removes the reference exactly.
        max_references: cap on the number of separate references (default 10, as Krea's API).
        moodboard: read the images together as ONE reference instead: 1 to
            :data:`MAX_MOODBOARD_IMAGES` images, ``style_strengths`` is None (0.35) or one number for the
            whole board; the returned list then holds that one strength.
        what: the arguments' prefix in messages (``style``: style_images; ``reference``: reference_images).

    Raises:
        ValueError: strengths without images, more or fewer strengths than images, a negative or
            non-finite strength, or too many images.
    """
    count = _count_images(style_images)
    if moodboard and count == 0:
        raise ValueError(f"a moodboard takes 1 to {MAX_MOODBOARD_IMAGES} images, got none")
    if count == 0:
        if style_strengths is not None and not (isinstance(style_strengths, (list, tuple)) and not style_strengths):
            raise ValueError(f"{what}_strengths given without {what}_images")
        return []
    if moodboard:
        if count > MAX_MOODBOARD_IMAGES:
            raise ValueError(f"a moodboard takes at most {MAX_MOODBOARD_IMAGES} images, got {count}")
        if isinstance(style_strengths, (list, tuple)):
            if len(style_strengths) != 1:
                raise ValueError(f"a moodboard has one strength for the whole board, got {len(style_strengths)} strengths")
            style_strengths = style_strengths[0]
        return [DEFAULT_MOODBOARD_STRENGTH if style_strengths is None else _check_strength(style_strengths, "moodboard strength")]
    if isinstance(max_references, bool) or not isinstance(max_references, int) or max_references < 1:
        raise ValueError(f"max_references must be a positive integer, got {max_references!r}")
    if count > max_references:
        hint = " (pass moodboard=True to read many images together as one direction)" if what == "style" else ""
        raise ValueError(f"at most {max_references} {what} images are supported, got {count}{hint}")
    if style_strengths is None:
        return [DEFAULT_STYLE_STRENGTH] * count
    if not isinstance(style_strengths, (list, tuple, np.ndarray, torch.Tensor)):
        return [_check_strength(style_strengths, f"{what} strength")] * count
    strengths = [s.item() if isinstance(s, (np.generic, torch.Tensor)) else s for s in style_strengths]
    if len(strengths) != count:
        raise ValueError(f"got {len(strengths)} {what} strengths for {count} {what} images; give one strength per image")
    return [_check_strength(s, f"{what} strength {i}") for i, s in enumerate(strengths)]


def parse_style_ref(spec: str) -> tuple[str, float]:
    """Parse the CLI's ``--style-ref PATH[:STRENGTH]`` (strength defaults to 1).

    Windows drive letters and colons inside file names stay in the path (see
    :func:`files.split_path_and_number`): ``C:\\a.png:0.6`` -> (``C:\\a.png``, 0.6).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--style-ref needs PATH or PATH:STRENGTH, got {spec!r}")
    path, strength = split_path_and_number(spec, DEFAULT_STYLE_STRENGTH)
    return path, _check_strength(strength, f"strength in --style-ref {spec!r}")


# ------------------------------------------------------------------------------------ vision tokens
def vision_config_of(text_encoder):
    """The vision tower's config (patch_size, temporal_patch_size, spatial_merge_size)."""
    config = getattr(text_encoder, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise ValueError(f"{type(text_encoder).__name__} has no vision tower (config.vision_config); "
                         "style references need the Qwen3-VL text encoder")
    return vision


def reference_image_processor(text_encoder, max_pixels: int = REFERENCE_MAX_PIXELS, min_pixels: int = REFERENCE_MIN_PIXELS):
    """A Qwen2-VL/Qwen3-VL image processor built offline from the text encoder's vision config."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # transformers 4.x: one processor class, PIL-based
        from transformers import Qwen2VLImageProcessor as Processor

    vision = vision_config_of(text_encoder)
    factor = vision.patch_size * vision.spatial_merge_size
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels must be at least {factor * factor} (one merged {factor}x{factor} patch), got {max_pixels}")
    return Processor(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size, merge_size=vision.spatial_merge_size,
        image_mean=list(QWEN3_VL_IMAGE_MEAN), image_std=list(QWEN3_VL_IMAGE_STD),
        min_pixels=min(min_pixels, max_pixels), max_pixels=max_pixels,
    )


def vision_inputs(text_encoder, images: Sequence[PIL.Image.Image], max_pixels: int = REFERENCE_MAX_PIXELS,
                  image_processor=None) -> tuple[torch.Tensor | None, torch.Tensor | None, list[int]]:
    """Preprocess images for the vision tower.

    Returns:
        pixel_values (sum of patches, C * temporal_patch * patch^2) float, image_grid_thw (K, 3) long
        (None, None for no images), and the number of LLM tokens of each image (its patches / merge^2).
    """
    if not images:
        return None, None, []
    processor = image_processor or reference_image_processor(text_encoder, max_pixels)
    out = processor(images=[to_rgb(image) for image in images], return_tensors="pt")
    grid = out["image_grid_thw"].long()
    merge = vision_config_of(text_encoder).spatial_merge_size
    tokens = (grid.prod(-1) // (merge * merge)).tolist()
    return out["pixel_values"], grid, tokens


def vision_block(tokens: int) -> str:
    """The text of one image's placeholder: start marker, one ``<|image_pad|>`` per LLM token, end marker."""
    return VISION_START + IMAGE_PAD * tokens + VISION_END


def token_id(tokenizer, token: str, expected: int | None) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == getattr(tokenizer, "unk_token_id", object()):
        raise ValueError(f"tokenizer has no {token} token; style references need the Qwen3-VL tokenizer")
    if expected is not None and found != expected:
        raise ValueError(f"tokenizer maps {token} to {found} but the text encoder expects {expected}")
    return found


def _tap(hidden_states, layers) -> torch.Tensor:
    if max(layers) >= len(hidden_states):
        raise ValueError(f"text encoder has {len(hidden_states) - 1} layers; tapped layers {tuple(layers)} need {max(layers)}")
    return torch.stack([hidden_states[i] for i in layers], dim=2)


@torch.no_grad()
def encode_prompt_with_images(
    text_encoder, tokenizer, prompt: str, images: Sequence, layers=TAPPED_LAYERS,
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH, *, max_pixels: int = REFERENCE_MAX_PIXELS,
    image_processor=None, device=None,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Encode one prompt with reference images as vision tokens before it, in the Krea 2 template.

    Layout: ``[system prefix | (<|vision_start|> <|image_pad|> x n_k <|vision_end|>) per image | prompt |
    suffix]``, no padding. ``max_sequence_length`` bounds the prompt and suffix as in
    :func:`~krea2_diffusers.conditioning.text.encode_prompts`; vision tokens come on top. Positions come
    from the encoder's own mRoPE index (vision tokens get (t, h, w) grid positions; text counts on).
    With no images this equals ``encode_prompts(text_encoder, tokenizer, [prompt])``.

    Returns:
        embeds (1, L, len(layers), hidden) in the encoder's dtype, mask (1, L) bool (all True), and
        groups: ``groups[k] = (start, end)``, the range of image k's ``<|image_pad|>`` tokens in the
        returned (prefix-dropped) sequence.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {prompt!r}")
    counts = template_counts(tokenizer)
    if max_sequence_length <= counts.suffix:
        raise ValueError(f"max_sequence_length must exceed the template suffix ({counts.suffix} tokens), got {max_sequence_length}")
    model = base_text_model(text_encoder)
    config = getattr(model, "config", None)
    device = device or next(model.parameters()).device
    images = load_reference_images(images)
    pixel_values, grid, tokens = vision_inputs(text_encoder, images, max_pixels, image_processor)
    image_token = token_id(tokenizer, IMAGE_PAD, getattr(config, "image_token_id", None)) if images else None

    # Prefix, vision blocks and prompt are tokenized together, as encode_prompts does for prefix + prompt;
    # the special tokens split the text, so the blocks tokenize exactly as written.
    vision_text = "".join(vision_block(n) for n in tokens)
    vision_len = len(tokenizer(vision_text, add_special_tokens=False).input_ids) if images else 0
    head = tokenizer(SYSTEM_PREFIX + vision_text + prompt, add_special_tokens=False, truncation=True,
                     max_length=counts.prefix + vision_len + max_sequence_length - counts.suffix).input_ids
    suffix = tokenizer(ASSISTANT_SUFFIX, add_special_tokens=False).input_ids
    input_ids = torch.tensor([head + suffix], dtype=torch.long, device=device)
    mask = torch.ones_like(input_ids, dtype=torch.bool)

    if images:
        # Token types: 0 text, 1 image (the encoder's convention for its mRoPE index).
        token_types = (input_ids == image_token).int()
        positions = _mrope_positions(model, input_ids, token_types, grid.to(device), mask)
        extra = dict(pixel_values=pixel_values.to(device), image_grid_thw=grid.to(device))
        if takes_token_types(model.get_rope_index):
            extra["mm_token_type_ids"] = token_types
    else:
        positions = (mask.long().cumsum(-1) - 1).unsqueeze(0).expand(3, -1, -1)
        extra = {}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, **extra)
    embeds = _tap(out.hidden_states, layers)[:, counts.prefix:]
    groups = _runs(input_ids[0, counts.prefix:], image_token) if images else []
    if [end - start for start, end in groups] != tokens:
        raise ValueError(f"vision tokens of {len(images)} images were not found intact after the template prefix "
                         f"(expected runs {tokens}, got {groups}); is this the Qwen3-VL tokenizer?")
    return embeds, mask[:, counts.prefix:], groups


def takes_token_types(function) -> bool:
    """transformers 5 identifies vision tokens by ``mm_token_type_ids``; 4.x finds them by id."""
    return "mm_token_type_ids" in inspect.signature(function).parameters


def _mrope_positions(model, input_ids, token_types, grid, mask) -> torch.Tensor:
    """(3, 1, S) positions from the encoder's own mRoPE index: vision tokens get (t, h, w) grid
    positions, text counts on after each image's largest grid side."""
    if takes_token_types(model.get_rope_index):
        positions, _ = model.get_rope_index(input_ids, mm_token_type_ids=token_types, image_grid_thw=grid, attention_mask=mask)
    else:
        positions, _ = model.get_rope_index(input_ids, image_grid_thw=grid, attention_mask=mask)
    return positions


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of ``token`` in a 1-D id tensor."""
    hits = (ids == token).int()
    edges = torch.diff(torch.nn.functional.pad(hits, (1, 1)))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))
