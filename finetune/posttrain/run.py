"""From a post-training config to the method's trainer."""

from __future__ import annotations

from .config import PosttrainConfig


def trainer_for(config: PosttrainConfig, resume: bool = False):
    if config.method == "dpo":
        from .dpo import DPOTrainer as cls
    elif config.method == "grpo":
        from .grpo import GRPOTrainer as cls
    else:
        from .tdm import DistillTrainer as cls
    return cls(config, resume)


def posttrain(config: PosttrainConfig, resume: bool = False):
    """Run (or, with ``resume``, continue) the post-training described by ``config``."""
    return trainer_for(config, resume).train()
