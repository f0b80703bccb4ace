"""The frozen encoders a training run names on its own: ``text_encoder`` and ``vae``, each a hub id,
a diffusers folder, a single file, or ``tiny-random``. Loading itself is the core package's."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TextEncoder:
    """A frozen Qwen3-VL with its tokenizer and the layers the transformer taps."""

    model: torch.nn.Module
    tokenizer: object

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds (B, L, 12, text_dim) and mask (B, L) bool, L = the longest prompt's tokens."""
        from krea2_diffusers.conditioning.text import encode_prompts

        embeds, mask = encode_prompts(self.model, self.tokenizer, prompts, max_sequence_length=max_sequence_length, device=device)
        return embeds, mask.bool()


def load_text_encoder(spec: str, dtype: torch.dtype = torch.bfloat16, device=None) -> TextEncoder:
    """The frozen text encoder named by ``spec`` (see :func:`krea2_diffusers.loaders.assembly.load_text_encoder`)."""
    from krea2_diffusers.loaders import assembly

    model = assembly.load_text_encoder(spec, dtype)
    tokenizer = assembly.load_tokenizer(None, spec)
    model.requires_grad_(False).eval()
    return TextEncoder(model.to(device) if device is not None else model, tokenizer)


def load_vae(spec: str, dtype: torch.dtype = torch.float32, device=None) -> torch.nn.Module:
    """The frozen VAE named by ``spec`` (see :func:`krea2_diffusers.loaders.assembly.load_vae`)."""
    from krea2_diffusers.loaders import assembly

    vae = assembly.load_vae(spec, dtype)
    vae.requires_grad_(False).eval()
    return vae.to(device) if device is not None else vae
