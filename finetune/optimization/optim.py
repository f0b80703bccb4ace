"""Optimizers and learning-rate schedules.

``optimizer.name``: ``adamw`` (torch), ``adamw8bit`` (bitsandbytes), ``prodigy`` (prodigyopt's
Prodigy: AdamW whose step size it estimates itself, ``learning_rate`` multiplying the estimate),
``adafactor`` (``torch.optim.Adafactor``: in torch itself, so no package to add and the same state
dict / DTensor support as AdamW; transformers' version would bring its relative-step defaults,
which ignore ``learning_rate``) and ``adamw_schedulefree`` (schedulefree's AdamWScheduleFree, whose
weights are an interpolation while training and the averaged ("eval-mode") weights otherwise: see
:func:`eval_weights`). Optional packages are checked before any model loads
(:func:`check_optimizer_package`) and come with the ``optimizers`` extra.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Iterable, Iterator

import torch

from ..config_parser import ConfigError
from .config import LRSchedulerConfig, OptimizerConfig

# optimizer.name -> (module it needs, the pip requirement that installs it)
PACKAGES = {
    "adamw8bit": ("bitsandbytes", "bitsandbytes (pip install bitsandbytes) and a CUDA GPU"),
    "prodigy": ("prodigyopt", "prodigyopt: pip install 'krea2-diffusers[optimizers]' (or pip install prodigyopt)"),
    "adamw_schedulefree": ("schedulefree", "schedulefree: pip install 'krea2-diffusers[optimizers]' (or pip install schedulefree)"),
}


def check_optimizer_package(config: OptimizerConfig, strategy: str = "none") -> None:
    """Raise :class:`ConfigError` when ``optimizer.name`` needs a package that is not installed, or
    cannot run under the run's parallel ``strategy``; called before any model loads."""
    needed = PACKAGES.get(config.name)
    if needed is not None and importlib.util.find_spec(needed[0]) is None:
        raise ConfigError(f"optimizer.name={config.name} needs {needed[1]}")
    if config.name == "prodigy" and strategy == "fsdp":
        # prodigyopt sums its step-size estimate over the local tensors with .item() and all-reduces
        # only CUDA tensors of FSDP1 flat parameters: FSDP2's DTensor shards are not handled.
        raise ConfigError("optimizer.name=prodigy does not support FSDP2-sharded parameters (a multi-process full "
                          "fine-tune); use adamw, adafactor or adamw_schedulefree there")


def make_optimizer(params: list[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of ``config.name`` over ``params`` (parameters or parameter groups). A
    schedule-free optimizer is returned in train mode (it refuses to step otherwise)."""
    check_optimizer_package(config)
    kwargs = dict(lr=config.learning_rate, betas=tuple(config.betas), weight_decay=config.weight_decay, eps=config.eps)
    if config.name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    if config.name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, d_coef=config.d_coef, **kwargs)
    if config.name == "adafactor":
        # torch's defaults for its decay-rate exponent and epsilons (betas / eps are AdamW's terms).
        return torch.optim.Adafactor(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    if config.name == "adamw_schedulefree":
        from schedulefree import AdamWScheduleFree

        # Warmup, if any, comes from the run's schedule (lr_scheduler.warmup_steps), not a second one here.
        optimizer = AdamWScheduleFree(params, warmup_steps=0, **kwargs)
        optimizer.train()
        # train() looked each parameter up in the state (a defaultdict), leaving empty entries: DCP
        # takes a non-empty state for an initialised one and would then restore nothing into it.
        for param in [p for p, state in optimizer.state.items() if not state]:
            del optimizer.state[param]
        return optimizer
    return torch.optim.AdamW(params, **kwargs)


def has_eval_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the model's weights while training are not the ones to evaluate (schedule-free)."""
    # schedulefree's optimizers mark their mode in every parameter group; no other one has the key.
    return "train_mode" in optimizer.param_groups[0] and callable(getattr(optimizer, "eval", None))


@contextlib.contextmanager
def eval_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside: the model holds the weights to validate, checkpoint and export (schedule-free: its
    averaged x instead of the interpolation y it trains at; other optimizers: no change). A
    checkpoint written inside holds them and its optimizer state says so, so a resumed run switches
    back exactly as the uninterrupted one does on leaving."""
    if not has_eval_weights(optimizer) or not optimizer.param_groups[0]["train_mode"]:
        yield  # nothing to switch, or an enclosing eval_weights switched already (and switches back)
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


def state_bytes(name: str, shapes: Iterable[torch.Size]) -> int:
    """Bytes of the optimizer state of float32 parameters of these ``shapes``: AdamW two moments
    (8 / value), AdamW8bit two 8-bit moments (2), schedule-free ``z`` and the second moment (8),
    Prodigy two moments, ``s`` and the initial weights ``p0`` (16), Adafactor a row and a column
    second moment per matrix (4 x (rows + columns)) and a full one per vector."""
    per_value = {"adamw": 8, "adamw8bit": 2, "adamw_schedulefree": 8, "prodigy": 16}
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if name != "adafactor":
            total += per_value[name] * numel
        elif len(shape) >= 2:
            total += 4 * (numel // shape[-1] + numel // shape[-2])
        else:
            total += 4 * numel
    return total


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
