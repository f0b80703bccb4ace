"""From a post-training config to the method's trainer."""

from __future__ import annotations

from .config import PosttrainConfig


def trainer_class(config: PosttrainConfig):
    if config.method == "dpo":
        from .dpo import DPOTrainer as cls
    elif config.method == "grpo":
        from .grpo import GRPOTrainer as cls
    elif config.method == "draft":
        from .draft import DraftTrainer as cls
    else:
        from .tdm import DistillTrainer as cls
    return cls


def trainer_for(config: PosttrainConfig, resume: bool = False):
    return trainer_class(config)(config, resume)


def posttrain(config: PosttrainConfig, resume: bool = False):
    """Run (or, with ``resume``, continue) the post-training described by ``config``."""
    return trainer_for(config, resume).train()


def posttrain_dry_run(config: PosttrainConfig) -> str:
    """``krea2 posttrain --dry-run``: train's memory plan with the method's copies (reference,
    teacher, fake score, second adapter). Loads nothing but the configs."""
    from ..dryrun import dry_run

    return dry_run(config, trainer_class(config).model_copies(config))
