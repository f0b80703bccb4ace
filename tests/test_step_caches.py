"""diffusers' step caches on our transformer (``CacheMixin.enable_cache`` with our block registered in
diffusers' registry, krea2_diffusers.caching), the cache contexts our pipeline opens, the presets
and the forward counter."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig,
)

from krea2_diffusers import Krea2Pipeline, cache_preset
from krea2_diffusers.caching.forwards import ForwardCounter
from krea2_diffusers.caching.magcache import calibrate_magcache
from krea2_diffusers.caching.presets import TAYLORSEER_OUTPUT

STEPS = 10
CALL = dict(prompt="a red fox", height=48, width=48, num_inference_steps=STEPS, guidance_scale=3.5, output_type="latent")


@pytest.fixture(scope="module")
def pipe(tiny_pipe):
    """tiny-random with its own transformer (the hooks are registered on it; the session's stays untouched)."""
    own = Krea2Pipeline(**{**tiny_pipe.components, "transformer": copy.deepcopy(tiny_pipe.transformer)})
    own.set_progress_bar_config(disable=True)
    return own


def sample(pipe, **overrides):
    """(final packed latents, full transformer forwards per image)."""
    with ForwardCounter(pipe.transformer) as counter, torch.inference_mode():
        latents = pipe(**{**CALL, **overrides}, generator=torch.Generator().manual_seed(0)).images
    return latents, counter.forwards / latents.shape[0]


def never_and_often(name: str, pipe):
    """(a config that never skips, one that skips a lot) per diffusers cache."""
    if name == "fbcache":
        return FirstBlockCacheConfig(threshold=0.0), FirstBlockCacheConfig(threshold=10.0)
    if name == "taylorseer_attention":  # diffusers' default: the attention outputs predicted
        make = lambda interval: TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=2,
                                                      taylor_factors_dtype=torch.float32)
        return make(1), make(4)
    if name == "taylorseer_output":  # the preset's layout: the final layer predicted, the blocks skipped
        make = lambda interval: TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=2,
                                                      taylor_factors_dtype=torch.float32, **TAYLORSEER_OUTPUT)
        return make(1), make(4)
    ratios = calibrate_magcache(pipe, STEPS, **{k: v for k, v in CALL.items() if k != "num_inference_steps"})
    assert len(ratios) == STEPS and ratios[0] == 1.0 and all(r > 0 for r in ratios)
    return (MagCacheConfig(calibrate=True, num_inference_steps=STEPS),
            MagCacheConfig(threshold=10.0, max_skip_steps=3, retention_ratio=0.2, num_inference_steps=STEPS, mag_ratios=ratios))


@pytest.mark.parametrize("name", ["fbcache", "taylorseer_attention", "taylorseer_output", "magcache"])
def test_diffusers_cache_on_our_transformer(pipe, name):
    """Never skipping (threshold 0, interval 1, MagCache's calibration run) gives the uncached latents exactly;
    a high threshold evaluates fewer forwards and changes them; disable_cache() restores the uncached latents."""
    plain, plain_forwards = sample(pipe)
    assert plain_forwards == 2 * STEPS  # CFG: both branches every step
    never, often = never_and_often(name, pipe)
    pipe.transformer.enable_cache(never)
    try:
        same, forwards = sample(pipe)
    finally:
        pipe.transformer.disable_cache()
    assert torch.equal(same, plain) and forwards == plain_forwards
    pipe.transformer.enable_cache(often)
    try:
        cached, forwards = sample(pipe)
    finally:
        pipe.transformer.disable_cache()
    assert forwards < 0.8 * plain_forwards and not torch.equal(cached, plain)
    assert torch.equal(sample(pipe)[0], plain) and not pipe.transformer.is_cache_enabled


def test_every_call_layout_has_its_own_cache_state(pipe):
    """CFG batched, separate branches (batch_cfg=False) and a guidance interval (1-row calls outside it):
    each layout keeps its own cache state, so First-Block Cache at threshold 0 changes nothing in any."""
    for overrides, batched in (({"guidance_interval": (0.3, 0.8)}, True), ({}, False), ({"guidance_scale": 0.0}, True)):
        pipe.batch_cfg = batched
        try:
            plain, plain_forwards = sample(pipe, **overrides)
            with torch.inference_mode():
                pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.0))
                try:
                    cached, forwards = sample(pipe, **overrides)
                finally:
                    pipe.transformer.disable_cache()
        finally:
            pipe.batch_cfg = True
        assert torch.equal(cached, plain) and forwards == plain_forwards, overrides
    # the interval skipped the unconditional rows outside [0.3, 0.8]
    assert sample(pipe, guidance_interval=(0.3, 0.8))[1] < 2 * STEPS


@pytest.mark.parametrize("config", [FasterCacheConfig(), PyramidAttentionBroadcastConfig()])
def test_caches_that_cannot_apply_are_refused_with_the_reason(pipe, config):
    with pytest.raises(ValueError, match="own (grouped-query )?attention"):
        pipe.transformer.enable_cache(config)
    assert not pipe.transformer.is_cache_enabled


def test_cache_presets():
    """The documented presets: RAW's and Turbo's values, the threshold override, refusals."""
    assert cache_preset("fbcache", num_inference_steps=28) == FirstBlockCacheConfig(threshold=0.08)
    assert cache_preset("fbcache", num_inference_steps=8, distilled=True).threshold == 0.08
    assert cache_preset("fbcache", num_inference_steps=28, threshold=0.2).threshold == 0.2
    taylor = cache_preset("taylorseer", num_inference_steps=28)
    assert isinstance(taylor, TaylorSeerCacheConfig) and taylor.cache_interval == 3
    assert taylor.cache_identifiers == [r"^final_layer$"] and taylor.disable_cache_after_step == 27
    assert cache_preset("taylorseer", num_inference_steps=8, distilled=True).cache_interval == 3
    mag = cache_preset("magcache", num_inference_steps=28)
    assert isinstance(mag, MagCacheConfig) and mag.threshold == 0.06 and len(mag.mag_ratios) == 28
    assert len(cache_preset("magcache", num_inference_steps=8, distilled=True, mag_ratios=[1.0, 0.9, 0.8]).mag_ratios) == 8
    with pytest.raises(ValueError, match="dbcache_preset"):
        cache_preset("dbcache", num_inference_steps=28)
    with pytest.raises(ValueError, match="whole number"):
        cache_preset("taylorseer", num_inference_steps=28, threshold=2.5)
    with pytest.raises(ValueError, match=">= 0"):
        cache_preset("fbcache", num_inference_steps=28, threshold=-1)
