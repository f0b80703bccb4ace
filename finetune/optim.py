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
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.name == "constant":
        return 1.0
    if config.name == "cosine":
        span = max(1, max_steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # warmup-stable-decay: flat, then a linear decay over the last `decay_fraction` of the run.
    decay_steps = max(1, round(max_steps * config.decay_fraction))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - floor) * min(1.0, (step - decay_start) / decay_steps)


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config, max_steps))
