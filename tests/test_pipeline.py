"""End to end against diffusers.Krea2Pipeline, plus presets, guidance knobs and bad input."""

import logging

import numpy as np
import pytest
import torch

from krea2_diffusers import sampling

H, W = 64, 96  # non-square, 4 x 6 tokens


def noise(batch, seed=0):
    return torch.randn(batch, (H // 16) * (W // 16), 64, generator=torch.Generator().manual_seed(seed))


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("guidance,negative", [(0.0, None), (2.5, ["blurry, low quality", ""]), (1.0, None)])
@pytest.mark.parametrize("distilled", [False, True])
def test_same_latents_as_diffusers(tiny_pipe, oracle_pipe, guidance, negative, distilled):
    prompts = ["a red fox sitting in fresh snow at golden hour", "two cats"]
    tiny_pipe.register_to_config(is_distilled=distilled)
    oracle_pipe.register_to_config(is_distilled=distilled)
    try:
        kwargs = dict(height=H, width=W, num_inference_steps=5, guidance_scale=guidance, output_type="latent")
        ours = tiny_pipe(prompts, negative_prompt=negative, latents=noise(2), **kwargs).images
        theirs = oracle_pipe(prompts, negative_prompt=negative, latents=noise(2), **kwargs).images
    finally:
        tiny_pipe.register_to_config(is_distilled=False)
        oracle_pipe.register_to_config(is_distilled=False)
    assert ours.shape == theirs.shape == (2, 24, 64)
    assert rel_err(ours, theirs) < 1e-5
    assert rel_err(ours, noise(2)) > 0.01  # it did something


def test_same_images_as_diffusers_and_unbatched_cfg(tiny_pipe, oracle_pipe):
    kwargs = dict(height=H, width=W, num_inference_steps=3, guidance_scale=1.5, output_type="np")
    ours = tiny_pipe("a lighthouse", latents=noise(1), **kwargs).images
    theirs = oracle_pipe("a lighthouse", latents=noise(1), **kwargs).images
    assert ours.shape == (1, H, W, 3)
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
    tiny_pipe.batch_cfg = False
    try:
        separate = tiny_pipe("a lighthouse", latents=noise(1), **kwargs).images
    finally:
        tiny_pipe.batch_cfg = True
    np.testing.assert_allclose(separate, ours, atol=1e-5)


def test_generator_and_images_per_prompt_match_diffusers(tiny_pipe, oracle_pipe):
    kwargs = dict(height=H, width=W, num_inference_steps=2, guidance_scale=0.0, output_type="latent", num_images_per_prompt=2)
    ours = tiny_pipe(["a", "b c d"], generator=[torch.Generator().manual_seed(i) for i in range(4)], **kwargs).images
    theirs = oracle_pipe(["a", "b c d"], generator=[torch.Generator().manual_seed(i) for i in range(4)], **kwargs).images
    assert rel_err(ours, theirs) < 1e-5


def test_prompt_embeds_path_equals_prompt_path(tiny_pipe):
    embeds, mask = tiny_pipe.encode_prompt("a blue bird")
    neg, neg_mask = tiny_pipe.encode_prompt("")
    kwargs = dict(height=H, width=W, num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    a = tiny_pipe("a blue bird", latents=noise(1), **kwargs).images
    b = tiny_pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                  negative_prompt_embeds_mask=neg_mask, latents=noise(1), **kwargs).images
    assert rel_err(b, a) < 1e-6


def _stop_at_first_step(pipe, i, t, kw):
    pipe._interrupt = True
    return {}


def test_presets_fill_unset_steps_and_guidance(tiny_pipe):
    tiny_pipe(prompt="x", height=32, width=32, output_type="latent", callback_on_step_end=_stop_at_first_step)
    assert tiny_pipe.num_timesteps == 52 and tiny_pipe.preset.guidance_scale == 3.5
    tiny_pipe.register_to_config(is_distilled=True)
    try:
        tiny_pipe(prompt="x", height=32, width=32, output_type="latent", callback_on_step_end=_stop_at_first_step)
        assert tiny_pipe.num_timesteps == 8 and tiny_pipe.preset.guidance_scale == 0.0
    finally:
        tiny_pipe.register_to_config(is_distilled=False)


def test_guidance_interval(tiny_pipe):
    kwargs = dict(height=H, width=W, num_inference_steps=4, output_type="latent", latents=noise(1))
    full = tiny_pipe("a", guidance_scale=2.0, **kwargs).images
    off = tiny_pipe("a", guidance_scale=0.0, **kwargs).images
    never = tiny_pipe("a", guidance_scale=2.0, guidance_interval=(0.0, 0.0001), **kwargs).images
    always = tiny_pipe("a", guidance_scale=2.0, guidance_interval=(0.0, 1.0), **kwargs).images
    part = tiny_pipe("a", guidance_scale=2.0, guidance_interval=(0.5, 1.0), **kwargs).images
    assert rel_err(never, off) < 1e-6 and rel_err(always, full) < 1e-7
    assert rel_err(part, full) > 1e-4 and rel_err(part, off) > 1e-4


def test_interrupt_and_callback_latents(tiny_pipe):
    calls = []

    def stop(pipe, i, t, kw):
        calls.append(i)
        pipe._interrupt = True
        return {}

    tiny_pipe("a", height=32, width=32, num_inference_steps=5, output_type="latent", callback_on_step_end=stop)
    assert calls == [0]


def test_sizes_round_up_with_warning(tiny_pipe, caplog):
    with caplog.at_level(logging.WARNING):
        images = tiny_pipe("a", height=40, width=50, num_inference_steps=1, output_type="pil").images
    assert images[0].size == (64, 48)
    assert "rounding 40x50 up to 48x64" in caplog.text


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(num_inference_steps=2.5), "num_inference_steps"),
    (dict(guidance_scale=-1.0), "guidance_scale"),
    (dict(guidance_scale=float("nan")), "guidance_scale"),
    (dict(output_type="jpeg"), "output_type"),
    (dict(height=0), "height"),
    (dict(guidance_interval=(0.8, 0.2)), "guidance_interval"),
    (dict(negative_prompt=["a", "b", "c"], guidance_scale=1.0), "negative_prompt"),
])
def test_invalid_arguments(tiny_pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_pipe(["a", "b"], **{"height": 32, "width": 32, **kwargs})


def test_invalid_prompt(tiny_pipe):
    with pytest.raises(ValueError, match="prompt"):
        tiny_pipe(prompt=123, height=32, width=32)
    with pytest.raises(ValueError, match="exactly one"):
        tiny_pipe(height=32, width=32)


def test_schedule_matches_spec_formula():
    steps, n_tokens = 7, 1024
    mu_raw = 0.5 + (1.15 - 0.5) * (n_tokens - 256) / (6400 - 256)
    assert sampling.compute_mu(256) == pytest.approx(0.5) and sampling.compute_mu(6400) == pytest.approx(1.15)
    for mu, distilled in ((mu_raw, False), (1.15, True)):
        grid = np.linspace(1, 0, steps + 1)
        expected = [np.exp(mu) / (np.exp(mu) + (1 / t - 1)) if t > 0 else 0.0 for t in grid]
        got = sampling.sigma_schedule(steps, sampling.schedule_mu(n_tokens, distilled)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_schedule_matches_diffusers_scheduler(tiny_pipe):
    scheduler = tiny_pipe.scheduler
    mu = sampling.compute_mu(24)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
    np.testing.assert_allclose(sampling.sigma_schedule(6, mu).numpy(), scheduler.sigmas.numpy(), rtol=1e-6)


def test_euler_and_guidance_conventions():
    x, v = torch.ones(3), torch.full((3,), 2.0)
    assert torch.equal(sampling.euler_step(x, v, 1.0, 0.75), torch.full((3,), 0.5))
    c, u = torch.tensor([2.0]), torch.tensor([1.0])
    assert sampling.guided_velocity(c, u, 0.0).item() == 2.0
    # Krea's g equals the standard convention's scale g + 1
    g = 3.5
    assert sampling.guided_velocity(c, u, g).item() == pytest.approx((u + (g + 1) * (c - u)).item())


def test_default_guidance_is_the_preset(tiny_pipe):
    kwargs = dict(height=H, width=W, sigmas=[1.0, 0.6, 0.3], output_type="latent")
    default = tiny_pipe("a", latents=noise(1), **kwargs).images
    explicit = tiny_pipe("a", latents=noise(1), guidance_scale=3.5, **kwargs).images
    off = tiny_pipe("a", latents=noise(1), guidance_scale=0.0, **kwargs).images
    assert torch.equal(default, explicit) and rel_err(default, off) > 1e-4
