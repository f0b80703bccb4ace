"""A computable reward for examples/posttrain_grpo_tiny.yaml (a plug-in is any importable function)."""

import numpy as np


def brightness(images, prompts, metadata):
    """Mean pixel value in [0, 1] of each PIL image: one float per image."""
    return [float(np.asarray(image, dtype=np.float32).mean() / 255.0) for image in images]
