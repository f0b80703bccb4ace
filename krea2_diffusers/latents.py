"""Latent layout: 2x2 patch packing, RoPE coordinates and VAE (de)normalisation.

Shapes: VAE latents (B, 16, h, w) with h = H/8; packed tokens (B, h/2 * w/2, 64) whose features
are ordered (channel, patch row, patch col) and whose tokens run row-major over the patch grid.
"""

from __future__ import annotations

import torch

PATCH_SIZE = 2
VAE_SCALE_FACTOR = 8
# Pixels per transformer token side: the VAE's 8x times the 2x2 patch.
PIXELS_PER_TOKEN = VAE_SCALE_FACTOR * PATCH_SIZE


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, C * 4)."""
    b, c, h, w = latents.shape
    p = PATCH_SIZE
    x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, N, C * 4) -> (B, C, height/8, width/8) for an image of ``height`` x ``width`` pixels."""
    b, n, features = packed.shape
    p = PATCH_SIZE
    gh, gw = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    if gh * gw != n:
        raise ValueError(f"{n} latent tokens do not fit a {height}x{width} image ({gh}x{gw} tokens)")
    c = features // (p * p)
    x = packed.view(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, gh * p, gw * p)


def position_ids(text_len: int, grid_height: int, grid_width: int, device=None, first_axis: int = 0) -> torch.Tensor:
    """(text_len + gh * gw, 3) RoPE coordinates: text at (0, 0, 0), image cell (i, j) at (first_axis, i, j)."""
    rows = torch.arange(grid_height, device=device).repeat_interleave(grid_width)
    cols = torch.arange(grid_width, device=device).repeat(grid_height)
    image = torch.stack([torch.full_like(rows, first_axis), rows, cols], dim=-1)
    text = torch.zeros(text_len, 3, dtype=image.dtype, device=device)
    return torch.cat([text, image]).float()


def round_to_multiple(size: int) -> int:
    """Round a pixel size up to a multiple of the token size (16)."""
    return -(-int(size) // PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=like.device, dtype=like.dtype).view(shape)
    std = torch.tensor(vae.config.latents_std, device=like.device, dtype=like.dtype).view(shape)
    return mean, std


def to_vae_space(vae, latents: torch.Tensor) -> torch.Tensor:
    """Model latents (B, 16, h, w) -> the VAE's own (un-normalised) latents, as ComfyUI's LATENT holds them."""
    mean, std = _latent_stats(vae, latents)
    return latents * std + mean


def to_model_space(vae, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's own latents (B, 16, h, w) -> model latents: the inverse of :func:`to_vae_space`."""
    mean, std = _latent_stats(vae, latents)
    return (latents - mean) / std


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Model latents (B, 16, h, w) -> images (B, 3, 8h, 8w) in [0, 1]."""
    latents = latents.to(vae.dtype)
    # The Qwen-Image VAE is a video VAE: add a single frame axis.
    frames = vae.decode(to_vae_space(vae, latents)[:, :, None], return_dict=False)[0]
    return (frames[:, :, 0].float().clamp(-1, 1) + 1) / 2


def encode_images(vae, images: torch.Tensor, generator=None, sample: bool = False) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] -> model latents (B, 16, H/8, W/8): the inverse of :func:`decode_latents`.

    Uses the posterior mean unless ``sample`` is set.
    """
    pixels = (images.to(vae.dtype) * 2 - 1)[:, :, None]
    posterior = vae.encode(pixels).latent_dist
    latents = (posterior.sample(generator) if sample else posterior.mode())[:, :, 0]
    return to_model_space(vae, latents)
