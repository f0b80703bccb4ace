"""The thin layer between training and the core package's latent helpers (VAE normalisation,
2x2 patch packing, RoPE position ids). Training must see latents exactly as the sampler does, so
nothing here re-implements that maths: it calls :mod:`krea2_diffusers.latents`."""

from __future__ import annotations

import torch

from krea2_diffusers import latents as _latents


def encode_images(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> normalised latents (B, 16, H/8, W/8), the VAE posterior mode.

    The mode (not a sample) keeps cached latents deterministic; the flow-matching noise already
    provides the stochasticity.
    """
    vae = pipe.vae
    pixels = pixels.to(device=next(vae.parameters()).device)
    return _latents.encode_images(vae, pixels).float()


def vae_fingerprint_extra(pipe, version: int) -> dict:
    return {"version": version, "encode": "mode", "normalized": True}


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, 16, h, w) -> (B, h/2 * w/2, 64) tokens in the transformer's patch order."""
    return _latents.pack_latents(latents)


def position_ids(text_len: int, grid_height: int, grid_width: int, device: torch.device) -> torch.Tensor:
    """(text_len + grid_height * grid_width, 3) RoPE coordinates: text at the origin, image (0, i, j)."""
    return _latents.position_ids(text_len, grid_height, grid_width, device=device)
