"""Loss masks: where each training image is learned (``data.masks``).

A mask is an image of the same size as its training image:

- ``data.masks: true``: ``NAME.mask.EXT`` beside ``NAME.EXT`` (any image extension; such files are
  never samples themselves, :func:`finetune.data.dataset.scan_folder` leaves them out);
- ``data.masks: FOLDER``: ``FOLDER/NAME.EXT``, matched by the image's file name without its
  extension (so the names must be unique across the run's images).

How a mask is read: with an alpha channel (RGBA, LA, a palette with transparency) its alpha is the
weight and its colour is ignored (a cut-out subject on a transparent background); otherwise its
grey level (ITU-R 601 luma of a colour mask, a 16-bit grey mask by its full range). White (opaque)
is 1: trained; black (transparent) is 0: not trained; grey weighs in between, linearly.

The mask goes through the image's own crop and bucket resize, then is area-averaged over each
latent cell (8 x 8 pixels), so a latent pixel half covered by the subject weighs 0.5. A sample
without a mask trains everywhere (weight 1). Masks are read and checked when the dataset is
scanned, before any model loads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from krea2_diffusers.latents import VAE_SCALE_FACTOR

from .buckets import Bucket, resize_to_bucket
from .dataset import IMAGE_EXTENSIONS, DatasetError, Sample
from .encoding import pack_latents

MASK_SUFFIX = ".mask"
"""``NAME.mask.png``: the mask of ``NAME.png`` beside it (``data.masks: true``)."""
MASK_FORMAT_VERSION = 1
"""Part of a masked sample's latent cache key: a change in how masks are read re-encodes them."""


def mask_candidates(image: Path, masks: bool | str) -> list[Path]:
    """The existing files that could be ``image``'s mask under ``data.masks``."""
    if masks is True:
        folder, stem = image.parent, image.stem + MASK_SUFFIX
    else:
        folder, stem = Path(masks), image.stem
    return sorted(p for p in (folder / (stem + ext) for ext in IMAGE_EXTENSIONS) if p.is_file())


def read_mask(path: Path) -> np.ndarray:
    """(H, W) float32 weights in [0, 1]: alpha when the file has it, else the grey level."""
    try:
        with Image.open(path) as image:
            image.load()
            if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
                return np.asarray(image.convert("RGBA").getchannel("A"), dtype=np.float32) / 255.0
            if image.mode.startswith("I;16") or image.mode == "I":  # 16-bit grey PNGs
                return np.clip(np.asarray(image, dtype=np.float32) / 65535.0, 0.0, 1.0)
            return np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    except (OSError, ValueError) as err:  # PIL's errors for a file it cannot decode
        raise DatasetError(f"mask {path} is not a readable image ({err})") from None


def attach_masks(samples: list[Sample], masks: bool | str) -> list[Sample]:
    """``samples`` with their ``mask`` set where one exists; every mask is read and checked here.

    Raises :class:`DatasetError` (naming the file) for a missing mask folder, two masks for one
    image, two images sharing a name under a mask folder, a mask whose size is not its image's, or
    a mask that is black everywhere (nothing to train).
    """
    if masks is False:
        return samples
    if masks is not True and not Path(masks).is_dir():
        raise DatasetError(f"data.masks {masks!r} is not a folder (give a folder of masks, or true for NAME.mask.png beside each image)")
    if masks is not True:
        by_stem: dict[str, Path] = {}
        for sample in samples:
            other = by_stem.setdefault(sample.image_path.stem, sample.image_path)
            if other != sample.image_path:
                raise DatasetError(f"data.masks {masks!r} matches masks by file name, but {other} and {sample.image_path} "
                                   "share one; rename one of them, or use data.masks: true (NAME.mask.png beside each image)")
    out = []
    for sample in samples:
        found = mask_candidates(sample.image_path, masks)
        if len(found) > 1:
            raise DatasetError(f"{sample.image_path} has {len(found)} masks ({', '.join(p.name for p in found)}); keep one")
        if not found:
            out.append(sample)
            continue
        weights = read_mask(found[0])
        if (weights.shape[1], weights.shape[0]) != (sample.width, sample.height):
            raise DatasetError(f"mask {found[0]} is {weights.shape[1]}x{weights.shape[0]} but its image "
                               f"{sample.image_path} is {sample.width}x{sample.height}; a mask must have its image's size")
        if not weights.any():
            raise DatasetError(f"mask {found[0]} is black (or transparent) everywhere: its image would train nothing")
        out.append(dataclasses.replace(sample, mask=found[0]))
    return out


def mask_grid(sample: Sample, bucket: Bucket) -> torch.Tensor:
    """The sample's mask on its latent grid: (H/8, W/8) float32 in [0, 1] for ``bucket`` (W, H).

    Cropped and resized exactly as the image (:func:`finetune.data.cache.load_image_tensor`), with
    a box filter (each output pixel the area-weighted mean of the input pixels it covers, so no
    ringing outside [0, 1]), then averaged over each 8 x 8 latent cell.
    """
    image = Image.fromarray(read_mask(sample.mask), mode="F")
    if sample.crop is not None:
        image = image.crop(sample.crop)
    image = resize_to_bucket(image, bucket, Image.Resampling.BOX)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy())
    return F.avg_pool2d(pixels[None, None], VAE_SCALE_FACTOR)[0, 0].clamp(0.0, 1.0)


def packed_mask(masks: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, h, w) latent-grid weights -> (B, h/2 * w/2, channels * 4), aligned element by element
    with :func:`finetune.data.encoding.pack_latents` of (B, channels, h, w) latents."""
    return pack_latents(masks[:, None].expand(-1, channels, -1, -1).contiguous())
