"""The report's measures, as functions of image features (unit vectors, cosine = ``a @ b``) and pixels.

* ``concept``: the mean over the samples with the trigger of their best cosine to any training
  image; ``concept_share``: the share of those samples whose best match reaches the threshold,
  halfway between the base model's level (its samples of the same prompts) and a near copy's.
* ``copying``: the largest cosine of any sample to any single training image (memorisation shows as
  a sample that is a near copy). A *near copy* is a training image through the pipeline's own VAE
  (encoded, decoded): the closest a sample can come to it; its cosine to the original is the top
  of the scale.
* ``leak``: how far the samples without the trigger moved from the base's samples of the same
  prompts and seeds, in feature distance (``1 - cosine``) and in pixel distance (mean absolute
  difference at :data:`PIXEL_SIZE`), each divided by the same distance between two seeds of the
  base; ``leak`` is the mean of the two ratios (0: unchanged, 1: as changed as a new seed).
* ``diversity``: the mean pairwise feature distance among the samples of one prompt across seeds,
  averaged over prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import combinations

import torch

PIXEL_SIZE = 64
"""Pixel distances are taken at this size (area-resized): layout and colour, not sampler grain."""


@dataclass
class Reference:
    """The levels a run's measures are read against, measured once per run."""

    near_copy: float
    """Mean cosine of a training image to its near copy (the image through the VAE)."""
    base_concept: float | None
    """``concept`` of the base model's samples of the trigger prompts (None: no trigger prompts)."""
    base_copying: float | None
    """``copying`` of the base model's samples."""
    base_diversity: float | None
    seed_feature: float | None
    """Mean feature distance between two seeds of the base, over the prompts without the trigger."""
    seed_pixel: float | None

    @property
    def concept_threshold(self) -> float | None:
        if self.base_concept is None:
            return None
        return self.base_concept + 0.5 * (self.near_copy - self.base_concept)

    def to_dict(self) -> dict:
        return {**asdict(self), "concept_threshold": self.concept_threshold}

    @classmethod
    def from_dict(cls, values: dict) -> "Reference":
        return cls(**{k: values.get(k) for k in cls.__dataclass_fields__})


def best_match(samples: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """(N, D), (T, D) -> (N,): each sample's largest cosine to a training image."""
    return (samples @ train.T).max(dim=1).values


def concept(samples: torch.Tensor, train: torch.Tensor, threshold: float | None) -> tuple[float | None, float | None]:
    """(N, D) samples with the trigger -> (mean best match, share at or above ``threshold``)."""
    if not len(samples):
        return None, None
    best = best_match(samples, train)
    share = None if threshold is None else float((best >= threshold).float().mean())
    return float(best.mean()), share


def copying(samples: torch.Tensor, train: torch.Tensor) -> float:
    """(N, D) -> the largest cosine of any sample to any training image."""
    return float(best_match(samples, train).max())


def near_copy(train: torch.Tensor, copies: torch.Tensor) -> float:
    """(T, D) training images and (C <= T, D) near copies of the first C -> their mean cosine."""
    return float((train[:len(copies)] * copies).sum(-1).mean())


def spread(group: torch.Tensor) -> float | None:
    """(S, D) samples of one prompt -> their mean pairwise feature distance (None for one sample)."""
    pairs = list(combinations(range(len(group)), 2))
    if not pairs:
        return None
    return sum(1.0 - float(group[i] @ group[j]) for i, j in pairs) / len(pairs)


def diversity(groups: list[torch.Tensor]) -> float | None:
    """Per prompt (S, D) samples -> the mean of their :func:`spread` (None with one seed)."""
    values = [s for s in (spread(g) for g in groups) if s is not None]
    return sum(values) / len(values) if values else None


def pixel_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, 3, h, w), (N, 3, h, w) in [0, 1] -> (N,) mean absolute differences."""
    return (a - b).abs().flatten(1).mean(1)


def seed_distances(features: list[torch.Tensor], pixels: list[torch.Tensor]) -> tuple[float | None, float | None]:
    """Per prompt (B, D) base features and (B, 3, h, w) pixels -> the mean (feature, pixel)
    distance between two of its seeds (None without a prompt)."""
    feature, pixel = [], []
    for f, p in zip(features, pixels):
        for i, j in combinations(range(len(f)), 2):
            feature.append(1.0 - float(f[i] @ f[j]))
            pixel.append(float(pixel_distance(p[i:i + 1], p[j:j + 1])))
    if not feature:
        return None, None
    return sum(feature) / len(feature), sum(pixel) / len(pixel)


def leak(features: list[torch.Tensor], pixels: list[torch.Tensor], base_features: list[torch.Tensor],
         base_pixels: list[torch.Tensor], reference: Reference) -> tuple[float | None, float | None, float | None]:
    """Per prompt without the trigger: (S, D) features and (S, 3, h, w) pixels of the trained model's
    samples, and the base's (B >= S copies, same seeds first) -> (leak, feature ratio, pixel ratio)."""
    if not features or not reference.seed_feature or not reference.seed_pixel:
        return None, None, None
    moved_f = torch.cat([1.0 - (f * b[:len(f)]).sum(-1) for f, b in zip(features, base_features)])
    moved_p = torch.cat([pixel_distance(p, b[:len(p)]) for p, b in zip(pixels, base_pixels)])
    feature = float(moved_f.mean()) / reference.seed_feature
    pixel = float(moved_p.mean()) / reference.seed_pixel
    return (feature + pixel) / 2, feature, pixel


def to_pixels(images) -> torch.Tensor:
    """PIL images -> (N, 3, PIXEL_SIZE, PIXEL_SIZE) float in [0, 1] (area-resized)."""
    import numpy as np

    arrays = [torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1) for image in images]
    return torch.stack([torch.nn.functional.interpolate(a[None], size=(PIXEL_SIZE, PIXEL_SIZE), mode="area")[0]
                        for a in arrays])
