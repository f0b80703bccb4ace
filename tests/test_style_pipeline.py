"""Weighted style references through the whole pipeline (tiny random components: mechanics only)."""

import numpy as np
import PIL.Image
import pytest
import torch

H = W = 32
# Tiny models: one thread (conftest.one_thread; with 2 threads a busy 2-core machine spends most of the
# time synchronising them).
pytestmark = pytest.mark.usefixtures("one_thread")


def picture(seed, size=(40, 24)):
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def latents():
    return torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))


def generate(pipe, **kwargs):
    base = dict(height=H, width=W, num_inference_steps=2, guidance_scale=1.0, output_type="latent", latents=latents())
    return pipe("a house by the sea", **{**base, **kwargs}).images


def dist(a, b):
    return (a - b).norm().item()


@pytest.mark.parametrize("mode", ["reference", "describe"])
def test_strength_zero_is_exactly_no_reference(tiny_pipe, mode):
    plain = generate(tiny_pipe)
    assert torch.equal(generate(tiny_pipe, style_images=[picture(1)], style_strengths=[0.0], style_mode=mode), plain)


def test_distance_grows_with_strength_reference_mode(tiny_pipe):
    plain = generate(tiny_pipe)
    d = [dist(generate(tiny_pipe, style_images=[picture(1)], style_strengths=[s]), plain) for s in (0.2, 1.0, 4.0)]
    assert 0 < d[0] < d[1] < d[2], d


def test_reference_mode_uses_reference_latents(tiny_pipe):
    a = generate(tiny_pipe, style_images=[picture(1)])
    b = generate(tiny_pipe, style_images=[picture(2)])
    assert dist(a, b) > 0


def test_describe_mode_mixes_and_caches(tiny_pipe):
    tiny_pipe._style_cache = type(tiny_pipe._style_cache)() if hasattr(tiny_pipe, "_style_cache") else None
    if tiny_pipe._style_cache is None:
        del tiny_pipe._style_cache
    refs = [picture(1), picture(2)]
    only_first = generate(tiny_pipe, style_images=refs[:1], style_mode="describe")
    cache = tiny_pipe._style_cache
    misses = cache.misses
    only_second = generate(tiny_pipe, style_images=refs[1:], style_mode="describe")
    mostly_first = generate(tiny_pipe, style_images=refs, style_strengths=[1.0, 1e-4], style_mode="describe")
    mostly_second = generate(tiny_pipe, style_images=refs, style_strengths=[1e-4, 1.0], style_mode="describe")
    even = generate(tiny_pipe, style_images=refs, style_strengths=[1.0, 1.0], style_mode="describe")
    # a repeated image is described once
    assert cache.misses == misses + 1 and cache.hits >= 4
    # the mix follows the strengths
    assert dist(mostly_first, only_first) < dist(mostly_first, only_second)
    assert dist(mostly_second, only_second) < dist(mostly_second, only_first)
    assert dist(even, only_first) > 1e-6 and dist(even, only_second) > 1e-6


@pytest.mark.parametrize("kwargs,match", [
    (dict(style_images=[picture(1)], style_strengths=[1.0, 2.0]), "strength"),
    (dict(style_images=[picture(1)], style_strengths=[-1.0]), "strength"),
    (dict(style_images=[picture(i) for i in range(11)]), "at most 10"),
    (dict(style_images=["/nonexistent/ref.png"]), "ref.png"),
    (dict(style_images=[picture(1)], style_mode="magic"), "style_mode"),
])
def test_bad_style_inputs_fail_before_model_work(tiny_pipe, kwargs, match, monkeypatch):
    def boom(*args, **kw):
        raise AssertionError("model work started")

    monkeypatch.setattr(tiny_pipe.transformer, "prepare_conditioning", boom)
    with pytest.raises(ValueError, match=match):
        generate(tiny_pipe, **kwargs)


def test_non_rgb_reference_is_converted(tiny_pipe):
    gray = picture(3).convert("L")
    rgba = picture(3).convert("RGBA")
    assert generate(tiny_pipe, style_images=[gray]).shape == generate(tiny_pipe, style_images=[rgba]).shape


def test_expanded_prompts_reported(tiny_pipe, monkeypatch):
    from krea2_diffusers.conditioning import expander

    real = expander.expand_prompts
    # random weights never stop on their own: keep the expansion short
    monkeypatch.setattr(expander, "expand_prompts", lambda *a, **kw: real(*a, **{**kw, "max_new_tokens": 6}))
    out = tiny_pipe("a cat", height=H, width=W, num_inference_steps=1, output_type="latent", creativity="raw")
    assert out.expanded_prompts == ["a cat"]
    out = tiny_pipe("a cat", height=H, width=W, num_inference_steps=1, output_type="latent", creativity="low",
                    expansion_seed=3)
    assert isinstance(out.expanded_prompts[0], str)
    assert out.expanded_prompts == [tiny_pipe.expand_prompt("a cat", creativity="low", seed=3)]
