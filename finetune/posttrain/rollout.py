"""Guidance-free rollouts for GRPO: the pipeline's schedule and conditioning, the sampler module's
SDE step (same marginals as the Euler ODE) on the exploring steps and its Euler step elsewhere.

Nothing here is a second sampler: times come from :func:`krea2_diffusers.sampling.sigma_schedule`,
steps from :func:`~krea2_diffusers.sampling.sde_step` / :func:`~krea2_diffusers.sampling.euler_step`,
latents are packed and decoded by :mod:`krea2_diffusers.latents`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from krea2_diffusers import sampling
from krea2_diffusers.latents import PATCH_SIZE, PIXELS_PER_TOKEN, decode_latents, pack_latents, position_ids, unpack_latents


@dataclass
class Rollout:
    """What GRPO needs to re-score the exploring steps under the current and reference weights.

    states / next_states: (S, B, N, C) latents before and after each exploring step; log_probs
    (S, B) under the rollout weights; times: S pairs (t, t_next); latents (B, N, C) the final sample.
    """

    states: torch.Tensor
    next_states: torch.Tensor
    log_probs: torch.Tensor
    times: list[tuple[float, float]]
    latents: torch.Tensor


def schedule(num_inference_steps: int, height: int, width: int, is_distilled: bool = False) -> list[float]:
    """The ``steps + 1`` times the pipeline samples ``height`` x ``width`` with."""
    tokens = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
    return sampling.sigma_schedule(num_inference_steps, sampling.schedule_mu(tokens, is_distilled)).tolist()


def initial_noise(batch: int, channels: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """Packed (B, N, C) standard normal latents, drawn as the pipeline draws them (unpacked, then packed)."""
    shape = (batch, channels // PATCH_SIZE**2, height // PIXELS_PER_TOKEN * PATCH_SIZE, width // PIXELS_PER_TOKEN * PATCH_SIZE)
    return pack_latents(torch.randn(shape, generator=generator))


def velocity(model, latents: torch.Tensor, t: float, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The transformer's velocity (B, N, C) at time ``t`` (a plain forward: LoRA/FSDP wrappers see it)."""
    timestep = torch.full((latents.shape[0],), t, device=latents.device, dtype=torch.float32)
    return model(hidden_states=latents, encoder_hidden_states=embeds, timestep=timestep, position_ids=positions,
                 encoder_attention_mask=mask, return_dict=False)[0].float()


def text_positions(embeds: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return position_ids(embeds.shape[1], height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN, embeds.device)


@torch.no_grad()
def sde_rollout(model, embeds, mask, noise: torch.Tensor, times: list[float], explore: list[int], noise_level: float,
                generator: torch.Generator, height: int, width: int) -> Rollout:
    """Sample without guidance from ``noise`` (B, N, C); steps in ``explore`` use the SDE.

    Args:
        embeds, mask: (B, L, layers, dim) and (B, L) conditioning, one row per sample.
        times: :func:`schedule`; explore: sorted step indices.
        generator: the SDE's noise (CPU), drawn step by step in order.
    """
    positions = text_positions(embeds, height, width)
    t_cap = times[1]  # the SDE's diffusion diverges at t = 1: the first step uses the second time's
    latents = noise.to(embeds.device, torch.float32)
    states, next_states, log_probs = [], [], []
    for i in range(len(times) - 1):
        t, t_next = times[i], times[i + 1]
        v = velocity(model, latents, t, embeds, mask, positions)
        if i in explore:
            step_noise = torch.randn(latents.shape, generator=generator).to(latents.device)
            following, mean, std = sampling.sde_step(latents, v, t, t_next, noise_level, noise=step_noise, t_cap=t_cap)
            states.append(latents)
            next_states.append(following)
            log_probs.append(sampling.gaussian_log_prob(following, mean, std))
            latents = following
        else:
            latents = sampling.euler_step(latents, v, t, t_next)
    return Rollout(torch.stack(states), torch.stack(next_states), torch.stack(log_probs),
                   [(times[i], times[i + 1]) for i in explore], latents)


@torch.no_grad()
def ode_samples(model, embeds, mask, noise, times: list[float], height: int, width: int) -> torch.Tensor:
    """Deterministic Euler samples (B, N, C), guidance-free, as the pipeline makes them with guidance 0."""
    positions = text_positions(embeds, height, width)
    latents = noise.to(embeds.device, torch.float32)
    for t, t_next in zip(times[:-1], times[1:]):
        latents = sampling.euler_step(latents, velocity(model, latents, t, embeds, mask, positions), t, t_next)
    return latents


def step_log_prob(model, state, following, t: float, t_next: float, t_cap: float, noise_level: float,
                  embeds, mask, positions) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(B,) log-density of ``state -> following`` under ``model``, the step's mean (B, N, C) and std."""
    v = velocity(model, state, t, embeds, mask, positions)
    _, mean, std = sampling.sde_step(state, v, t, t_next, noise_level, noise=torch.zeros_like(state), t_cap=t_cap)
    return sampling.gaussian_log_prob(following, mean, std), mean, std


@torch.no_grad()
def decode_to_pil(vae, latents: torch.Tensor, height: int, width: int) -> list:
    """Packed latents (B, N, C) -> PIL images."""
    from krea2_diffusers.pipeline import Krea2Pipeline

    pixels = decode_latents(vae, unpack_latents(latents.to(next(vae.parameters()).device), height, width))
    return Krea2Pipeline._to_output(pixels, "pil")
