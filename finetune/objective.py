"""Flow-matching objective, matching the sampler's convention (:mod:`krea2_diffusers.sampling`).

``x_t = (1 - t) x0 + t noise``, the transformer predicts the velocity ``noise - x0``, t in [0, 1]
with 1 = pure noise. Training times are drawn logit-normal (or uniform) and then pushed through
the same resolution-dependent exponential shift that RAW samples with, so training spends its
effort where sampling will spend its steps.
"""

from __future__ import annotations

import torch

from krea2_diffusers.sampling import compute_mu, noised, time_shift

from .config import ObjectiveConfig


def sample_timesteps(batch_size: int, image_seq_len: int, config: ObjectiveConfig, generator: torch.Generator) -> torch.Tensor:
    """(batch_size,) float32 training times in (0, 1).

    Args:
        image_seq_len: transformer image tokens per sample (latent cells / 4); sets mu.
        generator: CPU generator; the caller derives it from (seed, step) so runs are reproducible.
    """
    if config.timestep_sampling == "logit_normal":
        normal = torch.randn(batch_size, generator=generator, dtype=torch.float64)
        t = torch.sigmoid(config.logit_mean + config.logit_std * normal)
    else:
        t = torch.rand(batch_size, generator=generator, dtype=torch.float64)
    if config.shift == "resolution":
        t = time_shift(t, compute_mu(image_seq_len))
    elif config.shift == "fixed":
        t = time_shift(t, config.shift_mu)
    # Keep t strictly inside (0, 1): t = 0 carries no signal to learn and t = 1 none of x0.
    return t.clamp(1e-5, 1.0 - 1e-5).float()


def add_noise(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``(1 - t) * latents + t * noise``; latents/noise (B, N, C), t (B,): the sampler's
    :func:`krea2_diffusers.sampling.noised` (one noising step for training and sampling)."""
    return noised(latents, noise, t)


def loss_weights(t: torch.Tensor, weighting: str) -> torch.Tensor:
    """(B,) per-sample weights. ``cosmap`` and ``sigma_sqrt`` follow SD3's definitions, with the
    noise level sigma = t."""
    if weighting == "none":
        return torch.ones_like(t)
    if weighting == "sigma_sqrt":
        return (t ** -2.0).clamp(max=1e3)
    if weighting == "cosmap":
        bottom = 1 - 2 * t + 2 * t**2
        return 2 / (torch.pi * bottom)
    raise ValueError(f"unknown loss weighting {weighting!r}")


def flow_matching_losses(
    model_pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, weighting: str = "none"
) -> torch.Tensor:
    """(B,) weighted per-sample MSE between the predicted velocity and ``noise - latents``; all
    (B, N, C), t (B,). Computed in float32 whatever the autocast dtype."""
    target = noise.float() - latents.float()
    per_sample = (model_pred.float() - target).pow(2).flatten(1).mean(1)
    return loss_weights(t.float(), weighting) * per_sample


def flow_matching_loss(
    model_pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, weighting: str = "none"
) -> torch.Tensor:
    """The batch mean of :func:`flow_matching_losses`."""
    return flow_matching_losses(model_pred, latents, noise, t, weighting).mean()
