"""Flow-matching objective, matching the sampler's convention (:mod:`krea2_diffusers.sampling`).

``x_t = (1 - t) x0 + t noise``, the transformer predicts the velocity ``noise - x0``, t in [0, 1]
with 1 = pure noise. Training times come from :mod:`finetune.optimization.timesteps` (a sampler,
then the same resolution-dependent exponential shift that RAW samples with, so training spends its
effort where sampling will spend its steps: :func:`finetune.optimization.timesteps.sample_timesteps`).
"""

from __future__ import annotations

import torch

from krea2_diffusers.sampling import noised


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
    model_pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, weighting: str = "none",
    mask: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B,) weighted per-sample MSE between the predicted velocity and ``noise - latents``; all
    (B, N, C), t (B,). Computed in float32 whatever the autocast dtype.

    ``mask``: (B, N, C) loss weights in [0, 1] (:func:`finetune.data.masks.packed_mask`); a sample's
    loss is then ``sum(mask * err^2) / sum(mask)``: the mean over its masked area, so a small
    subject trains as strongly as a whole image, and an element of weight 0 gets exactly zero
    gradient. ``sample_weights``: (B,) factors, e.g. ``training.prior_loss_weight`` on regularisation samples.
    """
    target = noise.float() - latents.float()
    error = (model_pred.float() - target).pow(2)
    if mask is None:
        per_sample = error.flatten(1).mean(1)
    else:
        weights = mask.float().expand_as(error)
        # A mask cropped to nothing by its bucket has zero area: its sample then adds 0, not 0/0.
        per_sample = (weights * error).flatten(1).sum(1) / weights.flatten(1).sum(1).clamp_min(1e-12)
    per_sample = loss_weights(t.float(), weighting) * per_sample
    return per_sample if sample_weights is None else sample_weights.float() * per_sample


def flow_matching_loss(
    model_pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, weighting: str = "none",
    mask: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch mean of :func:`flow_matching_losses`."""
    return flow_matching_losses(model_pred, latents, noise, t, weighting, mask, sample_weights).mean()
