"""Sampling from an image's latents: ComfyUI's ``denoise`` schedule, inpainting, and bad latents refused."""

from __future__ import annotations

import pytest
import torch

from krea2_diffusers import sampling
from krea2_diffusers.img2img import check_image_latents, partial_sigmas, sample_from_latents
from krea2_diffusers.latents import pack_latents


@pytest.mark.parametrize("steps, denoise", [(8, 1.0), (8, 0.5), (4, 0.3), (52, 0.75)])
def test_partial_schedule_is_comfyuis_denoise(steps, denoise):
    """ComfyUI runs the last ``steps`` of a ``int(steps / denoise)``-step schedule."""
    mu = sampling.DISTILLED_SHIFT
    full = sampling.sigma_schedule(int(steps / denoise), mu)
    ours = sampling.sigma_schedule(steps, mu, partial_sigmas(steps, denoise))
    torch.testing.assert_close(ours, full[-(steps + 1):], rtol=0, atol=1e-12)


def test_inpainting_keeps_the_unmasked_region_exactly(tiny_pipe):
    x0 = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 4, 4)
    mask[:, :, 2:] = 1  # repaint the right half
    out = sample_from_latents(tiny_pipe, x0, 0.6, mask=mask, prompt="a fox", num_inference_steps=3,
                              generator=torch.Generator().manual_seed(1), output_type="latent").images
    kept = pack_latents(torch.cat([x0[..., :2], torch.zeros_like(x0[..., 2:])], -1))
    left = pack_latents(torch.cat([torch.ones_like(x0[..., :2]), torch.zeros_like(x0[..., 2:])], -1)).bool()
    assert torch.equal(out[left], kept[left])
    assert (out[~left] - pack_latents(x0)[~left]).abs().mean() > 1e-2  # the masked half was repainted


def test_small_denoise_changes_the_image_less(tiny_pipe):
    x0 = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))

    def distance(strength):
        out = sample_from_latents(tiny_pipe, x0, strength, prompt="a fox", num_inference_steps=2,
                                  generator=torch.Generator().manual_seed(1), output_type="latent").images
        return float((out - pack_latents(x0)).norm())

    assert distance(0.1) < distance(0.5) < distance(1.0)


@pytest.mark.parametrize("shape, message", [
    ((1, 4, 8, 8), "not \\(B, 16"), ((1, 16, 3, 8, 8), "3 frames"), ((1, 16, 1, 5, 8), "multiple of 16 pixels")])
def test_bad_latents_are_refused_naming_the_shape(shape, message):
    with pytest.raises(ValueError, match=message):
        check_image_latents(torch.zeros(shape))
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        partial_sigmas(4, 1.5)
