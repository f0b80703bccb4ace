"""cache-dit on our pipeline: ``cache_dit.enable_cache(pipe)`` finds our block adapter (registered by
krea2_diffusers.caching.registrations under cache-dit's ``Krea2`` name) and counts one step per
transformer call while CFG is batched; with separate CFG calls it matches diffusers' own
Krea2Pipeline + cache-dit (the peer) on the same weights and tokens."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import cache_dit
import pytest
import torch
from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
from krea2_diffusers.models.tiny import randomize_, tiny_transformer_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_pipeline import build  # noqa: E402  (ours and diffusers' pipeline on the same weights)
from cache_side_by_side import final_latents, same_tokens_call  # noqa: E402

STEPS = 28


def stats(pipe):
    summary = cache_dit.summary(pipe, details=False, logging=False)[0]
    return summary.accumulated_executed_steps, list(summary.cached_steps), list(summary.cfg_cached_steps)


def test_cache_dit_defaults_on_our_pipeline(tiny_pipe):
    """cache-dit's defaults (DBCache F8B0, 8 warm-up steps: a 9-block transformer) count every batched
    CFG call as one step (none as a "CFG branch"); disable_cache restores the uncached pipeline exactly."""
    torch.manual_seed(0)
    transformer = Krea2Transformer2DModel(**dict(tiny_transformer_config(), num_layers=9)).eval()
    randomize_(transformer, torch.Generator().manual_seed(0))
    pipe = Krea2Pipeline(**{**tiny_pipe.components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a red fox", height=32, width=32, num_inference_steps=12, guidance_scale=3.5, output_type="latent",
                latents=torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        plain = final_latents(pipe, call)[0]
        cache_dit.enable_cache(pipe)
        try:
            final_latents(pipe, call)
            steps, _, cfg_cached = stats(pipe)
        finally:
            cache_dit.disable_cache(pipe)
        assert steps == 12 and cfg_cached == []
        assert torch.equal(final_latents(pipe, call)[0], plain) and not hasattr(pipe, "_context_manager")


@pytest.fixture(scope="module")
def pair():
    """Ours and diffusers' pipeline on tiny-random's weights, with one call both read as the same tokens."""
    ours, theirs = build(components="tiny")
    call = dict(prompt="a red fox in the snow", height=64, width=64, num_inference_steps=STEPS, guidance_scale=3.5,
                output_type="latent", latents=torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        call = same_tokens_call(ours, call, call["prompt"])
    return ours, theirs, call


def dbcache_with_taylorseer():
    return dict(cache_config=DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=4, residual_diff_threshold=0.3),
                calibrator_config=TaylorSeerCalibratorConfig(taylorseer_order=1))


def cached(pipe, call):
    cache_dit.enable_cache(pipe, **dbcache_with_taylorseer())
    try:
        return final_latents(pipe, call)[0], stats(pipe)
    finally:
        cache_dit.disable_cache(pipe)


def test_cache_dit_dbcache_with_taylorseer_matches_the_diffusers_peer(pair):
    """DBCache + TaylorSeer calibrator. Separate CFG calls (batch_cfg=False, as diffusers calls): the same
    cached steps as the peer and the same latents (measured 5.4e-7 relative). Batched CFG (the default):
    28 steps counted, no call taken for a "CFG branch", one decision for both rows, so other steps may be
    cached; its latents are nearer the peer's (measured 1.5e-2 relative) than the uncached ones are (2.4e-2).
    cache-dit's own Krea2 adapter on our batched calls counted 14 steps (2.3e-2 from the peer)."""
    ours, theirs, call = pair
    relative = lambda a, b: float((a - b).norm() / b.norm())
    with torch.inference_mode():
        plain = final_latents(ours, call)[0]
        peer, (peer_steps, peer_cached, peer_cfg_cached) = cached(theirs, call)
        ours.batch_cfg = False
        try:
            separate, (steps, cached_steps, cfg_cached) = cached(ours, call)
        finally:
            ours.batch_cfg = True
        batched, (batched_steps, batched_cached, batched_cfg) = cached(ours, call)
    assert peer_steps == steps == batched_steps == STEPS
    assert peer_cached and (cached_steps, cfg_cached) == (peer_cached, peer_cfg_cached)
    assert relative(separate, peer) < 1e-5
    assert batched_cached and batched_cfg == [] and max(batched_cached) < STEPS
    assert relative(batched, peer) < relative(plain, peer)


def test_cache_dit_refuses_cached_references_clearly(tiny_pipe):
    """Cached reference keys/values are per block; cache-dit swaps the block list for its own wrapper,
    so that combination is refused (joint references run)."""
    import PIL.Image

    pipe = Krea2Pipeline(**{**tiny_pipe.components, "transformer": copy.deepcopy(tiny_pipe.transformer)})
    pipe.set_progress_bar_config(disable=True)
    style = PIL.Image.new("RGB", (32, 32), (200, 30, 30))
    call = dict(prompt="a fox", height=32, width=32, num_inference_steps=2, guidance_scale=3.5, output_type="latent",
                style_images=[style])
    with torch.inference_mode():
        cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(Fn_compute_blocks=1, max_warmup_steps=1))
        try:
            with pytest.raises(ValueError, match="reference_attention='joint'"):
                pipe(**call, reference_attention="cached")
            assert pipe(**call, reference_attention="joint").images.shape[0] == 1
        finally:
            cache_dit.disable_cache(pipe)
