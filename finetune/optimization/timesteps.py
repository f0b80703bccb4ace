"""Training times: where on the noise path each sample is trained (``objective.timestep_sampling``).

t in (0, 1), 1 = pure noise (``x_t = (1 - t) x0 + t noise``). A sampler draws t, then the shift
(``objective.shift``) moves it as RAW's sampler moves its steps. The samplers, with ``N`` a standard
normal and ``U`` uniform on [0, 1):

* ``logit_normal``: ``sigmoid(logit_mean + logit_std * N)`` (SD3's logit-normal);
* ``uniform``: ``U``;
* ``sigmoid``: ``sigmoid(sigmoid_scale * N)`` (ai-toolkit's and SimpleTuner's ``sigmoid``: the
  logit-normal centred at 0, its width under its own key);
* ``mode``: ``f(U) = 1 - U - mode_scale * (cos^2(pi U / 2) - 1 + U)`` (SD3's mode sampling, eq. 20
  of Esser et al. 2024); ``f`` is monotone for ``mode_scale`` in [-1, 2 / (pi - 2)], so
  ``P(t <= x) = 1 - f^-1(x)``; the law is symmetric about 1/2 (``f(1 - u) = 1 - f(u)``), so the
  direction of t does not matter; 0 is uniform, positive values favour the middle;
* ``beta``: ``Beta(beta_alpha, beta_beta)`` on t itself (``beta_alpha > beta_beta`` favours noise).

Every draw comes from the caller's generator (derived from the seed and the step), so a resumed
run draws the same times; ``beta`` seeds numpy's generator from it (torch's gamma sampler takes no
generator).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from krea2_diffusers.sampling import compute_mu, time_shift

from .config import ObjectiveConfig

SAMPLERS = ("logit_normal", "uniform", "sigmoid", "mode", "beta")


def unshifted_timesteps(batch_size: int, config: ObjectiveConfig, generator: torch.Generator) -> torch.Tensor:
    """(batch_size,) float64 times of ``config.timestep_sampling``, before the shift."""
    kind = config.timestep_sampling
    if kind in ("logit_normal", "sigmoid"):
        normal = torch.randn(batch_size, generator=generator, dtype=torch.float64)
        if kind == "sigmoid":
            return torch.sigmoid(config.sigmoid_scale * normal)
        return torch.sigmoid(config.logit_mean + config.logit_std * normal)
    if kind == "uniform":
        return torch.rand(batch_size, generator=generator, dtype=torch.float64)
    if kind == "mode":
        u = torch.rand(batch_size, generator=generator, dtype=torch.float64)
        return 1 - u - config.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    if kind == "beta":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))
        draws = np.random.default_rng(seed).beta(config.beta_alpha, config.beta_beta, batch_size)
        return torch.from_numpy(draws.astype(np.float64))
    raise ValueError(f"objective.timestep_sampling: unknown sampler {kind!r} (one of {SAMPLERS})")


def sample_timesteps(batch_size: int, image_seq_len: int, config: ObjectiveConfig, generator: torch.Generator) -> torch.Tensor:
    """(batch_size,) float32 training times in (0, 1): the sampler's, then the shift.

    Args:
        image_seq_len: transformer image tokens per sample (latent cells / 4); sets mu.
        generator: CPU generator; the caller derives it from (seed, step) so runs are reproducible.
    """
    t = unshifted_timesteps(batch_size, config, generator)
    if config.shift == "resolution":
        t = time_shift(t, compute_mu(image_seq_len))
    elif config.shift == "fixed":
        t = time_shift(t, config.shift_mu)
    # Keep t strictly inside (0, 1): t = 0 carries no signal to learn and t = 1 none of x0.
    return t.clamp(1e-5, 1.0 - 1e-5).float()
