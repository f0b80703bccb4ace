"""Reward plug-ins used by the post-training tests (imported by name from the configs)."""

from __future__ import annotations

import numpy as np
import torch


def brightness(images, prompts, metadata):
    """Mean pixel value in [0, 1] of each decoded image."""
    return [float(np.asarray(image, dtype=np.float32).mean() / 255.0) for image in images]


def raises(images, prompts, metadata):
    raise RuntimeError("reward model crashed")


def too_few(images, prompts, metadata):
    return [0.5] * (len(images) - 1)


def not_a_number(images, prompts, metadata):
    return [float("nan")] * len(images)


class Threshold:
    """A class plug-in: built once with its options."""

    def __init__(self, value: float = 0.5):
        self.value = value

    def __call__(self, images, prompts, metadata):
        return [1.0 if b > self.value else 0.0 for b in brightness(images, prompts, metadata)]


# ---------------------------------------------------------------- differentiable (DRaFT): images (B, 3, H, W) in [0, 1]
def redness(images, prompts, metadata):
    """(B,) mean of red minus the mean of green and blue: pure torch, differentiable."""
    red, green, blue = images.unbind(1)
    return (red - (green + blue) / 2).flatten(1).mean(1)


def detached_redness(images, prompts, metadata):
    return redness(images.detach(), prompts, metadata)


def unrelated_tensor(images, prompts, metadata):
    """Requires grad, but through a parameter of its own, not the images."""
    return torch.zeros(images.shape[0], requires_grad=True) * 2


def redness_too_few(images, prompts, metadata):
    return redness(images, prompts, metadata)[:-1]


def redness_nan(images, prompts, metadata):
    return redness(images, prompts, metadata) * float("nan")
