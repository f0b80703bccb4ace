"""Image-to-image and inpainting on the tiny pipeline: the strength end points against their
definitions (text-to-image, the VAE round trip), the kept region of inpainting, and bad input."""

from __future__ import annotations

import logging

import numpy as np
import PIL.Image
import pytest
import torch

from krea2_diffusers import Krea2Img2ImgPipeline, Krea2InpaintPipeline
from krea2_diffusers.latents import decode_latents, encode_images, pack_latents, unpack_latents
from krea2_diffusers.pipelines.image_inputs import crop_region, latent_repaint_mask

H, W = 32, 48  # 2 x 3 tokens
pytestmark = pytest.mark.usefixtures("one_thread")


def picture(seed=0, size=(W, H)):
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def pixels(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)[None].contiguous()


def half_mask(size=(W, H), mode="L"):
    array = np.zeros((size[1], size[0]), np.uint8)
    array[:, size[0] // 2:] = 255  # repaint the right half (a whole number of 8-px latent cells)
    return PIL.Image.fromarray(array).convert(mode)


def gen():
    return torch.Generator().manual_seed(7)


@pytest.fixture(scope="module")
def img2img(tiny_pipe):
    return Krea2Img2ImgPipeline.from_pipe(tiny_pipe)


@pytest.fixture(scope="module")
def inpaint(tiny_pipe):
    return Krea2InpaintPipeline.from_pipe(tiny_pipe)


ARGS = dict(num_inference_steps=3, guidance_scale=1.0)


def test_from_pipe_shares_components(tiny_pipe, img2img, inpaint):
    for pipe in (img2img, inpaint):
        assert pipe.transformer is tiny_pipe.transformer and pipe.vae is tiny_pipe.vae
        assert pipe.text_encoder is tiny_pipe.text_encoder and pipe.is_distilled == tiny_pipe.is_distilled


def test_strength_one_equals_text_to_image(tiny_pipe, img2img):
    t2i = tiny_pipe("a boat", height=H, width=W, generator=gen(), output_type="latent", **ARGS).images
    i2i = img2img("a boat", image=picture(), strength=1.0, generator=gen(), output_type="latent", **ARGS).images
    assert torch.equal(i2i, t2i)


def test_strength_zero_is_the_vae_round_trip(tiny_pipe, img2img):
    image = picture(1)
    out = img2img("a boat", image=image, strength=0.0, generator=gen(), output_type="pt", **ARGS).images
    with torch.no_grad():
        expected = decode_latents(tiny_pipe.vae, encode_images(tiny_pipe.vae, pixels(image)))
    assert out.shape == (1, 3, H, W)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_intermediate_strength_runs_the_tail_and_stays_nearer_the_image(tiny_pipe, img2img):
    image = picture(2)
    with torch.no_grad():
        x0 = pack_latents(encode_images(tiny_pipe.vae, pixels(image)))
    steps = []
    record = lambda pipe, i, t, kw: steps.append(float(t)) or kw
    low = img2img("a boat", image=image, strength=0.5, num_inference_steps=4, generator=gen(), output_type="latent",
                  callback_on_step_end=record).images
    assert len(steps) == 2 and steps[0] < 1000.0  # int(4 * 0.5) steps, starting inside the schedule
    high = img2img("a boat", image=image, strength=0.9, num_inference_steps=4, generator=gen(), output_type="latent").images
    assert (low - x0).norm() < (high - x0).norm()


def test_inpaint_keeps_the_unmasked_latent_exactly(tiny_pipe, inpaint):
    image = picture(3)
    out = inpaint("a boat", image=image, mask_image=half_mask(), strength=1.0, generator=gen(), output_type="latent", **ARGS).images
    with torch.no_grad():
        x0 = pack_latents(encode_images(tiny_pipe.vae, pixels(image)))  # posterior mode
    repaint = latent_repaint_mask(torch.from_numpy(np.asarray(half_mask(), np.float32) / 255)[None, None], 16)
    assert 0 < repaint.float().mean() < 1
    assert torch.equal(out[~repaint], x0[~repaint])
    assert (out[repaint] - x0[repaint]).abs().max() > 1e-3  # the masked half was repainted
    # the kept half is the left half of the latent image
    kept = unpack_latents(~repaint, H, W)
    assert bool(kept[..., : W // 16].all()) and not bool(kept[..., W // 16:].any())


def test_all_white_mask_is_img2img(img2img, inpaint):
    white = PIL.Image.new("L", (W, H), 255)
    a = inpaint("a boat", image=picture(4), mask_image=white, strength=0.7, generator=gen(), output_type="latent", **ARGS).images
    b = img2img("a boat", image=picture(4), strength=0.7, generator=gen(), output_type="latent", **ARGS).images
    assert torch.equal(a, b)


def test_size_mismatch_is_resized_with_a_warning(inpaint, caplog):
    with caplog.at_level(logging.WARNING):
        out = inpaint("a boat", image=picture(5, (60, 40)), mask_image=half_mask((30, 20)), height=H, width=W,
                      generator=gen(), output_type="pt", **ARGS).images
    assert out.shape == (1, 3, H, W)
    assert "image is 60x40, the target is 48x32: resizing" in caplog.text
    assert "mask_image is 30x20, the target is 48x32: resizing" in caplog.text


def test_rgb_mask_is_converted(inpaint, caplog):
    kwargs = dict(image=picture(6), strength=1.0, output_type="latent", **ARGS)
    gray = inpaint("a boat", mask_image=half_mask(), generator=gen(), **kwargs).images
    with caplog.at_level(logging.WARNING):
        rgb = inpaint("a boat", mask_image=half_mask(mode="RGB"), generator=gen(), **kwargs).images
    assert "converting it to one channel" in caplog.text
    assert torch.equal(rgb, gray)


@pytest.mark.parametrize("strength", [-0.1, 1.5, float("nan"), "0.5", True])
def test_strength_outside_unit_interval_is_an_error(img2img, inpaint, strength):
    with pytest.raises(ValueError, match="strength"):
        img2img("a boat", image=picture(), strength=strength)
    with pytest.raises(ValueError, match="strength"):
        inpaint("a boat", image=picture(), mask_image=half_mask(), strength=strength)


def test_latent_input_equals_pixel_input(tiny_pipe, img2img):
    """ComfyUI-style callers pass model latents (B, 16, h, w) instead of pixels."""
    image = picture(8)
    with torch.no_grad():
        latents = encode_images(tiny_pipe.vae, pixels(image))
    a = img2img("a boat", image=latents, strength=0.6, generator=gen(), output_type="latent", **ARGS).images
    b = img2img("a boat", image=image, strength=0.6, generator=gen(), output_type="latent", **ARGS).images
    assert torch.equal(a, b)


def test_padding_mask_crop_pastes_back_into_the_original(inpaint):
    original = picture(9, (96, 64))
    mask = np.zeros((64, 96), np.uint8)
    mask[20:30, 40:50] = 255
    # white 40..49 x 20..29, grown by 4 to 36..53 x 16..33 (18x18), widened to 27x18: the 3:2 target aspect
    assert crop_region(PIL.Image.fromarray(mask), W, H, 4) == (32, 16, 59, 34)
    out = inpaint("a boat", image=original, mask_image=PIL.Image.fromarray(mask), padding_mask_crop=4, height=H, width=W,
                  generator=gen(), output_type="np", **ARGS).images
    assert out.shape == (1, 64, 96, 3)
    keep = mask == 0
    np.testing.assert_array_equal((out[0][keep] * 255).round().astype(np.uint8), np.asarray(original)[keep])
