"""The sections of a training run that say what is minimized and how: ``optimizer``,
``lr_scheduler``, ``objective`` and ``training.ema``. Checked with the rest of the run's config by
:meth:`finetune.config.TrainConfig.validate`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree"] = "adamw"
    """``prodigy`` (prodigyopt; ``learning_rate`` scales its own step-size estimate: use 1.0),
    ``adafactor`` (``torch.optim.Adafactor``: ``learning_rate`` and ``weight_decay``, torch's
    defaults for the rest), ``adamw_schedulefree`` (schedulefree; ``lr_scheduler.name`` constant,
    its warmup kept; validation, checkpoints and exports hold its averaged eval-mode weights).
    See :mod:`finetune.optimization.optim`."""
    learning_rate: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    d_coef: float = 1.0
    """``prodigy`` only: multiplies its step-size estimate (below 1 for a gentler run)."""


@dataclass
class LRSchedulerConfig:
    name: Literal["constant", "cosine", "wsd"] = "constant"
    warmup_steps: int = 0
    decay_fraction: float = 0.2
    """``wsd`` only: fraction of the run spent decaying to ``min_lr_ratio``."""
    min_lr_ratio: float = 0.0
    """``cosine`` / ``wsd``: the rate where the schedule ends, after the last update (every update
    runs above it; see :func:`finetune.optimization.optim.lr_multiplier`)."""


@dataclass
class ObjectiveConfig:
    timestep_sampling: Literal["logit_normal", "uniform", "sigmoid", "mode", "beta"] = "logit_normal"
    """Before the shift (formulas in :mod:`finetune.optimization.timesteps`): ``logit_normal``
    sigmoid(logit_mean + logit_std N(0, 1)); ``uniform`` U(0, 1); ``sigmoid`` sigmoid(sigmoid_scale
    N(0, 1)); ``mode`` SD3's mode sampling with ``mode_scale``; ``beta`` Beta(beta_alpha, beta_beta)."""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    sigmoid_scale: float = 1.0
    mode_scale: float = 1.29
    """In [-1, 2 / (pi - 2)] (= 1.752), where SD3's mode map stays monotone in [0, 1]; 0 is uniform."""
    beta_alpha: float = 2.0
    beta_beta: float = 2.0
    shift: Literal["resolution", "fixed", "none"] = "resolution"
    """``resolution``: mu linear from 0.5 at 256 image tokens to 1.15 at 6400; ``fixed``: ``shift_mu``."""
    shift_mu: float = 1.15
    loss_weighting: Literal["none", "cosmap", "sigma_sqrt"] = "none"


@dataclass
class EMAConfig:
    """An exponential moving average of the trainable parameters (:mod:`finetune.optimization.ema`)."""

    decay: float = 0.999
    """Per update: ``ema = decay * ema + (1 - decay) * weights``."""
    every_n_steps: int = 1
    """Update after every N-th optimizer step (the decay applies per update)."""
    on_cpu: bool = False
    """Keep the average in host memory (frees accelerator memory; each update copies the weights out)."""
    export: Literal["ema", "raw", "both"] = "ema"
    """What the run exports: the average (``ema``), the trained weights (``raw``), or both (the
    average in the usual files, the trained weights in ``<output_dir>/raw/``). Validation samples
    the average either way."""
    warmup: bool | int = True
    """The decay starts low and rises, so the average forgets the starting weights (a LoRA's zero B
    matrices): at the update after ``n`` earlier ones it is ``min(decay, (1 + n) / (1 + n + k))``.
    ``true``: ``k = 9``, diffusers' ``EMAModel`` schedule ``(1 + n) / (10 + n)``; it averages about the
    last tenth of the run until it reaches ``decay`` (0.999 after 8,990 updates). An integer N: a
    warm-up whose horizon is N optimizer steps, ``k`` set so that the decay reaches ``decay`` at step
    N (a longer horizon tracks the weights more closely meanwhile: ``k`` is smaller); N must be at
    least :func:`shortest_warmup` (999 steps at 0.999, ``k = 1``, a running mean), shorter would
    average over more updates than there were. ``false``: ``decay`` from the first update (before
    the warm-up existed; what runs recorded without this key did)."""


def shortest_warmup(config: EMAConfig) -> int:
    """The shortest ``warmup`` horizon (optimizer steps) that forgets the starting weights: the one
    with ``k = 1``, where the warm-up is a running mean of every update so far."""
    updates = config.decay / (1 - config.decay)  # k = updates * (1 - decay) / decay = 1
    return config.every_n_steps * math.ceil(updates - 1e-9)
