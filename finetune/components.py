"""The frozen encoders a training run names on its own: ``text_encoder`` and ``vae``, each a hub id,
a diffusers folder, a single file, or ``tiny-random``. Loading itself is the core package's."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from krea2_diffusers.models.tiny import is_tiny


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


@functools.lru_cache(maxsize=1)
def _tiny():
    """One tiny pipeline's components (frozen, so the text encoder and VAE may share the build)."""
    from krea2_diffusers.models.tiny import tiny_components

    return tiny_components()


def load_text_encoder(spec: str, dtype: torch.dtype = torch.bfloat16, device=None) -> TextEncoder:
    from krea2_diffusers import assembly

    if is_tiny(spec):
        parts = _tiny()
        model, tokenizer = parts["text_encoder"], parts["tokenizer"]
    else:
        model = assembly.load_text_encoder(spec, dtype)
        tokenizer = assembly.load_tokenizer(None, spec)
    model.requires_grad_(False).eval()
    return TextEncoder(model.to(device) if device is not None else model, tokenizer)


def load_vae(spec: str, dtype: torch.dtype = torch.float32, device=None) -> torch.nn.Module:
    from krea2_diffusers import assembly

    vae = _tiny()["vae"] if is_tiny(spec) else assembly.load_vae(spec, dtype)
    vae.requires_grad_(False).eval()
    return vae.to(device) if device is not None else vae
