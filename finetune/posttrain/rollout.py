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

from ..engine.parallel import unwrap

# Parameter-name prefixes of the timestep-independent text path (Krea2Transformer2DModel.prepare_conditioning).
TEXT_PATH = ("text_fusion.", "txt_in.")


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


def velocity(model, latents: torch.Tensor, t: float, text: dict) -> torch.Tensor:
    """The transformer's velocity (B, N, C) at time ``t`` (a plain forward: LoRA/FSDP wrappers see
    it); ``text`` from :func:`text_inputs`."""
    timestep = torch.full((latents.shape[0],), t, device=latents.device, dtype=torch.float32)
    return model(hidden_states=latents, timestep=timestep, return_dict=False, **text)[0].float()


def text_positions(embeds: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return position_ids(embeds.shape[1], height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN, embeds.device)


def text_fusion_frozen(model: torch.nn.Module) -> bool:
    """True when no trained weight acts on the text path (the usual LoRA): its output is then
    the same for every step, for the trained model and for the reference."""
    return not any(p.requires_grad for n, p in unwrap(model).named_parameters() if n.startswith(TEXT_PATH))


def text_inputs(model, embeds: torch.Tensor, mask: torch.Tensor, height: int, width: int, reuse: bool) -> dict:
    """The transformer's text keyword arguments. With ``reuse`` (:func:`text_fusion_frozen`) the
    text fusion runs once here, as the pipeline does per generation, instead of in every forward."""
    positions = text_positions(embeds, height, width)
    if reuse:
        with torch.no_grad():
            return {"conditioning": unwrap(model).prepare_conditioning(embeds, positions, mask)}
    return dict(encoder_hidden_states=embeds, position_ids=positions, encoder_attention_mask=mask)


@torch.no_grad()
def sde_rollout(model, text: dict, noise: torch.Tensor, times: list[float], explore: list[int], noise_level: float,
                generator: torch.Generator, rows: slice | None = None, total: int | None = None) -> Rollout:
    """Sample without guidance from ``noise`` (B, N, C); steps in ``explore`` use the SDE.

    Args:
        text: :func:`text_inputs`, one row per sample.
        times: :func:`schedule`; explore: sorted step indices.
        generator: the SDE's noise (CPU), drawn step by step in order.
        rows, total: these samples are rows ``rows`` of a global batch of ``total`` split over
            processes; each step draws the whole batch's noise and keeps these rows, so a sample's
            noise does not depend on the number of processes.
    """
    t_cap = times[1]  # the SDE's diffusion diverges at t = 1: the first step uses the second time's
    latents = noise.float()
    states, next_states, log_probs = [], [], []
    for i in range(len(times) - 1):
        t, t_next = times[i], times[i + 1]
        v = velocity(model, latents, t, text)
        if i in explore:
            shape = latents.shape if total is None else (total, *latents.shape[1:])
            step_noise = torch.randn(shape, generator=generator)[rows or slice(None)].to(latents.device)
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
def ode_samples(model, text: dict, noise, times: list[float]) -> torch.Tensor:
    """Deterministic Euler samples (B, N, C), guidance-free, as the pipeline makes them with guidance 0."""
    latents = noise.float()
    for t, t_next in zip(times[:-1], times[1:]):
        latents = sampling.euler_step(latents, velocity(model, latents, t, text), t, t_next)
    return latents


def step_log_prob(model, state, following, t: float, t_next: float, t_cap: float, noise_level: float,
                  text: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(B,) log-density of ``state -> following`` under ``model``, the step's mean (B, N, C) and std."""
    v = velocity(model, state, t, text)
    _, mean, std = sampling.sde_step(state, v, t, t_next, noise_level, noise=torch.zeros_like(state), t_cap=t_cap)
    return sampling.gaussian_log_prob(following, mean, std), mean, std


@torch.no_grad()
def decode_to_pil(vae, latents: torch.Tensor, height: int, width: int) -> list:
    """Packed latents (B, N, C) -> PIL images."""
    from krea2_diffusers.pipelines.text_to_image import Krea2Pipeline

    pixels = decode_latents(vae, unpack_latents(latents.to(next(vae.parameters()).device), height, width))
    return Krea2Pipeline.to_output(pixels, "pil")
