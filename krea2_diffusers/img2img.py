"""Sampling that starts from an image's latents instead of pure noise: img2img (``strength``, ComfyUI's
``denoise``) and, with a mask, inpainting.

A minimal layer over :class:`Krea2Pipeline`'s ``sigmas`` and ``latents`` arguments (kept separate so a
dedicated img2img/inpaint pipeline can replace it). ``strength`` follows ComfyUI's ``denoise``: the
schedule of ``round(steps / strength)`` steps is built and only its last ``steps`` are run, starting
from ``x_t = (1 - t) x0 + t noise`` at that schedule's time t. Inpainting keeps the region outside the
mask on the noised original at every step, so it returns exactly there.
"""

from __future__ import annotations

import torch

from . import sampling
from .latents import PATCH_SIZE, VAE_SCALE_FACTOR, pack_latents

LATENT_CHANNELS = 16


def partial_sigmas(num_inference_steps: int, strength: float) -> list[float]:
    """The unshifted time grid (``num_inference_steps`` values in (0, 1], no final 0) of a run that
    starts ``strength`` of the way into the noise, as ComfyUI's ``denoise`` does."""
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"strength (denoise) must be in (0, 1], got {strength!r}")
    total = max(num_inference_steps, int(num_inference_steps / strength))
    grid = torch.linspace(1.0, 0.0, total + 1, dtype=torch.float64)
    return grid[-(num_inference_steps + 1):-1].tolist()


def check_image_latents(latents: torch.Tensor, source: str = "latent") -> torch.Tensor:
    """(B, 16, h, w) or (B, 16, 1, h, w) -> (B, 16, h, w); refuses other channels, frames or odd sizes."""
    if latents.ndim == 5:
        if latents.shape[2] != 1:
            raise ValueError(f"{source}: {latents.shape[2]} frames in shape {tuple(latents.shape)}; Krea 2 takes single images")
        latents = latents[:, :, 0]
    if latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"{source}: shape {tuple(latents.shape)} is not (B, {LATENT_CHANNELS}, [1,] H/8, W/8) "
                         "(the Qwen-Image VAE's 16 latent channels)")
    if latents.shape[-2] % PATCH_SIZE or latents.shape[-1] % PATCH_SIZE:
        raise ValueError(f"{source}: latent size {tuple(latents.shape[-2:])} gives an image that is not a multiple of "
                         f"{PATCH_SIZE * VAE_SCALE_FACTOR} pixels")
    return latents


def _mask_at(mask: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """A (B, H, W), (H, W) or (B, 1, H, W) mask in [0, 1] -> packed like ``latents`` (1 = repaint)."""
    mask = mask.float()
    while mask.ndim < 4:
        mask = mask.unsqueeze(0 if mask.ndim < 3 else 1)
    mask = torch.nn.functional.interpolate(mask[:, :1], size=latents.shape[-2:], mode="bilinear", align_corners=False)
    mask = mask.clamp(0, 1).expand(latents.shape[0], latents.shape[1], -1, -1)
    return pack_latents(mask.contiguous())


def sample_from_latents(pipe, image_latents: torch.Tensor, strength: float, mask: torch.Tensor | None = None,
                        num_inference_steps: int | None = None, generator=None, callback_on_step_end=None, **kwargs):
    """Run ``pipe`` from ``image_latents`` (model space, (B, 16, h, w); B = the batch the call makes).

    Args:
        strength: ComfyUI's ``denoise`` in (0, 1]: 1 ignores the image, small values change it little.
        mask: optional inpainting mask (1 = repaint), pixel or latent resolution.
        kwargs: the rest of ``pipe(...)``'s arguments (prompt, guidance_scale, output_type ...); height
            and width follow from the latents.
    """
    x0 = image_latents.float()
    height, width = x0.shape[-2] * VAE_SCALE_FACTOR, x0.shape[-1] * VAE_SCALE_FACTOR
    steps = num_inference_steps or pipe.preset.num_inference_steps
    sigmas = partial_sigmas(steps, strength)
    mu = sampling.schedule_mu((height // (PATCH_SIZE * VAE_SCALE_FACTOR)) * (width // (PATCH_SIZE * VAE_SCALE_FACTOR)),
                              pipe.is_distilled)
    times = sampling.sigma_schedule(steps, mu, sigmas).tolist()
    generators = generator if isinstance(generator, list) else [generator] * x0.shape[0]
    noise = torch.cat([torch.randn(x0[i:i + 1].shape, generator=g, dtype=torch.float32) for i, g in enumerate(generators)])
    clean, noise = pack_latents(x0), pack_latents(noise)
    start = (1 - times[0]) * clean + times[0] * noise
    keep = None if mask is None else 1 - _mask_at(mask, x0)

    def on_step_end(p, i, timestep, tensors):
        if keep is not None and "latents" in tensors:
            t_next = times[i + 1]
            original = ((1 - t_next) * clean + t_next * noise).to(tensors["latents"])
            weight = keep.to(original)
            tensors["latents"] = tensors["latents"] * (1 - weight) + original * weight  # exact where weight is 1
        return callback_on_step_end(p, i, timestep, tensors) if callback_on_step_end is not None else tensors

    inputs = list(kwargs.pop("callback_on_step_end_tensor_inputs", ["latents"]))
    if "latents" not in inputs:
        inputs.append("latents")
    return pipe(height=height, width=width, sigmas=sigmas, latents=start, callback_on_step_end=on_step_end,
                callback_on_step_end_tensor_inputs=inputs, **kwargs)
