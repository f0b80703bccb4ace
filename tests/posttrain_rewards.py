"""Reward plug-ins used by the post-training tests (imported by name from the configs)."""

from __future__ import annotations

import numpy as np


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
