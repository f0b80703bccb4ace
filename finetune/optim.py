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
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based; ``max_steps`` and
    beyond: the schedule's end, what the rate would be after the last update).

    Warmup: step ``s < warmup_steps`` has ``(s + 1) / warmup_steps`` (the first step already
    moves, the last warmup step is at the full rate). ``constant``: 1 after it.

    ``cosine`` and ``wsd`` then decay over their last ``decay_steps`` steps (``cosine``: all the
    steps after the warmup; ``wsd``: ``max(1, round(max_steps * decay_fraction))`` of them,
    after a flat part, the warmup stopping where the decay starts so a short run still decays),
    following torchtitan's ``linear_warmup_stable_decay``
    (``torchtitan/components/lr_scheduler.py``): decay step ``i`` (1-based) is at progress
    ``p = i / (decay_steps + 1)``, with ``floor + (1 - floor) (1 - p)`` (``wsd``) or
    ``floor + (1 - floor) (1 + cos(pi p)) / 2`` (``cosine``), ``floor = min_lr_ratio``. The
    floor is reached exactly at progress 1, i.e. at step ``max_steps``, after the last update:
    every one of the ``max_steps`` updates has a rate above the floor (above 0 with the default
    floor 0; none is wasted), the last one ``(1 - floor) / (decay_steps + 1)`` above it for ``wsd``.
    (torchtitan's warmup is ``(s + 1) / (warmup_steps + 1)``; ours ends on the full rate.)
    A pure function of the step, so a resumed run gets the same rates.
    """
    floor = config.min_lr_ratio
    step = min(step, max_steps)
    if config.name == "wsd":
        decay_steps = min(max_steps, max(1, round(max_steps * config.decay_fraction)))
    else:
        decay_steps = max(0, max_steps - config.warmup_steps)
    decay_start = max_steps - decay_steps
    if config.name != "constant" and decay_steps and step >= decay_start:
        # Integer numerator: at step max_steps it is 0 and floor + (1 - floor) * 0 is the floor exactly.
        left = (decay_steps - (step - decay_start)) / (decay_steps + 1)
        if config.name == "wsd":
            return floor + (1 - floor) * left
        # (1 + cos(pi p)) / 2 = sin^2(pi (1 - p) / 2): exactly 1 - 1 = 0 (the floor) at the end, and
        # no cancellation just before it, where 1 + cos(pi p) would lose the small rate.
        return floor + (1 - floor) * math.sin(0.5 * math.pi * left) ** 2
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    return 1.0


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` whose restored state is the step alone: on load each group keeps the run's own
    base rate (its config's, which the checkpoint's fingerprint matches) and gets ``base *
    multiplier(step)``, so a checkpoint with other parameter groups (an older distillation's fake
    score at ``distribution_weight: 0``) resumes on the same rates."""

    def load_state_dict(self, state_dict: dict) -> None:
        step = state_dict["last_epoch"]
        rates = [base * fn(step) for base, fn in zip(self.base_lrs, self.lr_lambdas, strict=True)]
        # Our multipliers are plain functions: nothing of theirs is in the state to restore.
        super().load_state_dict({**state_dict, "base_lrs": list(self.base_lrs), "_last_lr": rates,
                                 "lr_lambdas": [None] * len(self.lr_lambdas)})
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, max_steps: int) -> StepSchedule:
    return StepSchedule(optimizer, lambda step: lr_multiplier(step, config, max_steps))
