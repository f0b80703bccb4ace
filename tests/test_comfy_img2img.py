"""ComfyUI's img2img / inpainting on the library's pipelines: the ``denoise`` schedule (ComfyUI's
rule, not diffusers' ``strength``), the node's path through ``Krea2Img2ImgPipeline`` /
``Krea2InpaintPipeline``, and ComfyUI latents refused by shape."""

from __future__ import annotations

import pytest
import torch

from comfy_nodes.comfy_bridge import check_image_latents
from comfy_nodes.nodes import sample_from_image
from krea2_diffusers import sampling
from krea2_diffusers.latents import pack_latents

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("steps, denoise", [(8, 1.0), (8, 0.5), (4, 0.3), (52, 0.75)])
def test_denoise_schedule_is_comfyuis(steps, denoise):
    """ComfyUI runs the last ``steps`` of a ``int(steps / denoise)``-step schedule."""
    mu = sampling.DISTILLED_SHIFT
    full = sampling.sigma_schedule(int(steps / denoise), mu)
    ours = sampling.sigma_schedule(steps, mu, sampling.denoise_sigmas(steps, denoise))
    torch.testing.assert_close(ours, full[-(steps + 1):], rtol=0, atol=1e-12)


def _sample(pipe, x0, denoise, steps, mask=None):
    return sample_from_image(pipe, x0, denoise, steps, mask, "a fox", "", 1, guidance_scale=0.0,
                             generator=[torch.Generator().manual_seed(1)], output_type="latent").images


def test_denoise_one_is_text_to_image(tiny_pipe):
    """denoise 1 starts on pure noise: the image is ignored, as in ComfyUI."""
    x0 = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    ours = _sample(tiny_pipe, x0, 1.0, 2)
    text_to_image = tiny_pipe("a fox", negative_prompt="", height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                              generator=[torch.Generator().manual_seed(1)], output_type="latent").images
    torch.testing.assert_close(ours, text_to_image, rtol=0, atol=0)


def test_inpainting_keeps_the_unmasked_region_exactly(tiny_pipe):
    x0 = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 32, 32)
    mask[:, :, 16:] = 1  # repaint the right half (pixels; latent columns 2-3)
    out = _sample(tiny_pipe, x0, 0.6, 3, mask=mask)
    kept = pack_latents(torch.cat([x0[..., :2], torch.zeros_like(x0[..., 2:])], -1))
    left = pack_latents(torch.cat([torch.ones_like(x0[..., :2]), torch.zeros_like(x0[..., 2:])], -1)).bool()
    assert torch.equal(out[left], kept[left])
    assert (out[~left] - pack_latents(x0)[~left]).abs().mean() > 1e-2  # the masked half was repainted


def test_small_denoise_changes_the_image_less(tiny_pipe):
    x0 = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))

    def distance(denoise):
        return float((_sample(tiny_pipe, x0, denoise, 2) - pack_latents(x0)).norm())

    assert distance(0.1) < distance(0.5) < distance(1.0)


@pytest.mark.parametrize("shape, message", [
    ((1, 4, 8, 8), "not \\(B, 16"), ((1, 16, 3, 8, 8), "3 frames"), ((1, 16, 1, 5, 8), "multiple of 16 pixels")])
def test_bad_latents_are_refused_naming_the_shape(shape, message):
    with pytest.raises(ValueError, match=message):
        check_image_latents(torch.zeros(shape))


@pytest.mark.parametrize("denoise", [0.0, 1.5, True])
def test_denoise_outside_its_range_is_refused(denoise):
    with pytest.raises(ValueError, match="denoise must be in \\(0, 1\\]"):
        sampling.denoise_sigmas(4, denoise)
