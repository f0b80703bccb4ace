"""Flow-matching objective, LR schedules and the checkpoint file format (no model needed)."""

import math

import pytest
import torch

from finetune.config import LRSchedulerConfig, ObjectiveConfig
from finetune.objective import add_noise, flow_matching_loss, loss_weights, sample_timesteps
from finetune.optim import lr_multiplier
from krea2_diffusers.sampling import compute_mu, time_shift


def _t(n, seq_len, **kw):
    return sample_timesteps(n, seq_len, ObjectiveConfig(**kw), torch.Generator().manual_seed(0))


def test_logit_normal_then_resolution_shift():
    plain = _t(20000, 4096, shift="none")
    assert abs(float(plain.median()) - 0.5) < 0.02  # logit-normal(0, 1) is centred on 0.5
    shifted = _t(20000, 4096)
    # Same draws, pushed through the sampler's own shift at this resolution.
    assert torch.allclose(shifted, time_shift(plain.double(), compute_mu(4096)).float().clamp(1e-5, 1 - 1e-5), atol=1e-6)
    assert float(_t(20000, 6400).mean()) > float(_t(20000, 256).mean())  # more tokens -> noisier
    fixed = _t(1000, 16, shift="fixed", shift_mu=1.15)
    assert torch.allclose(fixed, time_shift(_t(1000, 16, shift="none").double(), 1.15).float(), atol=1e-6)
    uniform = _t(20000, 256, timestep_sampling="uniform", shift="none")
    assert 0 < float(uniform.min()) and float(uniform.max()) < 1 and abs(float(uniform.mean()) - 0.5) < 0.01


def test_velocity_target_is_noise_minus_data():
    x0, noise = torch.randn(3, 16, 64), torch.randn(3, 16, 64)
    t = torch.tensor([0.0, 0.5, 1.0])
    xt = add_noise(x0, noise, t)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[2], noise[2])
    assert torch.allclose(xt[1], 0.5 * x0[1] + 0.5 * noise[1])
    assert float(flow_matching_loss(noise - x0, x0, noise, t)) == 0.0
    assert math.isclose(float(flow_matching_loss(noise - x0 + 1.0, x0, noise, t)), 1.0, rel_tol=1e-6)
    t = torch.tensor([0.1, 0.5, 0.9])
    assert torch.allclose(loss_weights(t, "sigma_sqrt"), t**-2)
    assert float(loss_weights(torch.tensor([0.5]), "cosmap")) == pytest.approx(2 / (math.pi * 0.5))


@pytest.mark.parametrize("name", ["constant", "cosine", "wsd"])
def test_lr_schedules(name):
    config = LRSchedulerConfig(name=name, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    curve = [lr_multiplier(s, config, 100) for s in range(100)]
    assert curve[0] == pytest.approx(0.1) and curve[9] == pytest.approx(1.0)
    if name == "constant":
        assert curve[10:] == [1.0] * 90
    elif name == "cosine":
        assert all(a > b for a, b in zip(curve[10:], curve[11:])) and curve[10] == 1.0 and curve[-1] == 0.1
        for steps in (12, 13, 50):  # the floor exactly on the last step, whatever the length
            assert lr_multiplier(steps - 1, config, steps) == 0.1
    else:
        assert curve[10:80] == [1.0] * 70 and all(a > b for a, b in zip(curve[79:], curve[80:]))
        assert curve[80] == pytest.approx(0.1 + 0.9 * 19 / 20) and curve[-1] == 0.1  # the floor on the last step


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.2, 0.25, 1 / 3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("warmup", [0, 3])
def test_wsd_reaches_the_floor_exactly_on_the_last_step_for_every_length(fraction, warmup):
    """Lengths 1..50: flat (after warmup), then strictly decreasing, ending on exactly
    ``min_lr_ratio`` (compared with ==, floors that are not binary fractions included), with
    ``max(1, round(steps * fraction))`` decaying steps, the first of them already below 1."""
    for floor in (0.0, 0.1, 1 / 3):
        config = LRSchedulerConfig(name="wsd", warmup_steps=warmup, decay_fraction=fraction, min_lr_ratio=floor)
        for steps in range(1, 51):
            curve = [lr_multiplier(s, config, steps) for s in range(steps)]
            decay = min(steps, max(1, round(steps * fraction)))
            assert curve[-1] == floor, (steps, fraction, floor, curve)
            flat = curve[:steps - decay]
            assert all(v == 1.0 for v in flat[warmup:]) and all(v <= 1.0 for v in flat), (steps, curve)
            tail = curve[steps - decay:]
            assert all(a > b for a, b in zip(tail, tail[1:])) and tail[0] < 1.0, (steps, fraction, curve)
            assert tail[0] == pytest.approx(floor + (1 - floor) * (decay - 1) / decay)
