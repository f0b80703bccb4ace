"""A computable reward for examples/posttrain_grpo_tiny.yaml (a plug-in is any importable function)."""

import numpy as np


def brightness(images, prompts, metadata):
    """Mean pixel value in [0, 1] of each PIL image: one float per image."""
    return [float(np.asarray(image, dtype=np.float32).mean() / 255.0) for image in images]


def redness(images, prompts, metadata):
    """A differentiable reward for examples/posttrain_draft_tiny.yaml: ``images`` is a float tensor
    (B, 3, H, W) in [0, 1] carrying gradients; one value per image, as a tensor (B,)."""
    red, green, blue = images.unbind(1)
    return (red - (green + blue) / 2).flatten(1).mean(1)
