"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math

import torch

from .config import ConfigError, LRSchedulerConfig, OptimizerConfig


def make_optimizer(params: list[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    kwargs = dict(lr=config.learning_rate, betas=tuple(config.betas), weight_decay=config.weight_decay, eps=config.eps)
    if config.name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("optimizer.name=adamw8bit needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU") from None
        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def lr_multiplier(step: int, config: LRSchedulerConfig, max_steps: int) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based, < ``max_steps``).

    ``cosine``: linear warmup, then half a cosine from 1 (step ``warmup_steps``) to exactly
    ``min_lr_ratio`` on the last step (``max_steps - 1``).
    ``wsd``: warmup, flat, then a linear decay over the last ``decay_steps = max(1,
    round(max_steps * decay_fraction))`` steps whose last step (``max_steps - 1``) is exactly
    ``min_lr_ratio``: decay step ``i`` (1-based) has ``floor + (1 - floor) (1 - i / decay_steps)``.
    The warmup stops where the decay starts (a short run still ends on the floor).
    """
    floor = config.min_lr_ratio
    if config.name == "wsd":
        decay_steps = min(max_steps, max(1, round(max_steps * config.decay_fraction)))
        decay_start = max_steps - decay_steps
        if step >= decay_start:
            done = min(decay_steps, step - decay_start + 1)
            # floor + (1 - floor) * 0 is floor exactly (1 - (1 - floor) is not, in floating point).
            return floor + (1 - floor) * ((decay_steps - done) / decay_steps)
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.name == "constant" or config.name == "wsd":
        return 1.0
    # The last step (max_steps - 1) is the end of the half cosine: it is the floor, cos(pi) being -1 exactly.
    span = max(1, max_steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config, max_steps))
