"""Flow-matching objective, LR schedules and the checkpoint file format (no model needed)."""

import math

import pytest
import torch

from finetune.config import LRSchedulerConfig, ObjectiveConfig
from finetune.optimization.objective import add_noise, flow_matching_loss, loss_weights
from finetune.optimization.timesteps import sample_timesteps
from finetune.optimization.optim import lr_multiplier
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


# The schedules follow torchtitan's linear_warmup_stable_decay (finetune/optimization/optim.py): decay step i
# (1-based) of decay_steps is at progress p = i / (decay_steps + 1), the floor at p = 1, which is
# step max_steps, after the last update. The expected values below are that formula written out
# independently (cos form; the code uses the equal sin^2 form): they agree to a few ulps, far
# inside pytest.approx's default relative 1e-6.
def _decayed(name: str, floor: float, progress: float) -> float:
    shape = 1 - progress if name == "wsd" else 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * shape


@pytest.mark.parametrize("name", ["constant", "cosine", "wsd"])
def test_lr_schedules(name):
    config = LRSchedulerConfig(name=name, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    curve = [lr_multiplier(s, config, 100) for s in range(101)]  # 100 updates, then the schedule's end
    assert curve[0] == pytest.approx(0.1) and curve[9] == 1.0
    if name == "constant":
        assert curve[10:] == [1.0] * 91
    elif name == "cosine":  # 90 decay steps after the warmup
        assert all(a > b for a, b in zip(curve[9:], curve[10:]))
        assert curve[10] == pytest.approx(_decayed(name, 0.1, 1 / 91))
        assert curve[99] == pytest.approx(_decayed(name, 0.1, 90 / 91)) and curve[99] > 0.1
    else:  # 20 decay steps after 70 flat ones
        assert curve[10:80] == [1.0] * 70 and all(a > b for a, b in zip(curve[79:], curve[80:]))
        assert curve[80] == pytest.approx(0.1 + 0.9 * 20 / 21) and curve[99] == pytest.approx(0.1 + 0.9 / 21)
    if name != "constant":
        assert curve[100] == 0.1 and lr_multiplier(150, config, 100) == 0.1  # the floor after the last update


@pytest.mark.parametrize("name", ["wsd", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_decay_reaches_the_floor_after_the_last_update_for_every_length(name, warmup):
    """Lengths 1..50 (cosine: those longer than its warmup), decay fractions from none to all, floors
    0, 0.1 and 1/3: every one of the ``steps`` updates has a rate above 0 (none is wasted), the rate
    never rises after the warmup, the decaying updates stay above the floor, and the schedule's end
    (step ``steps``) is exactly ``min_lr_ratio`` (compared with ==, floors that are not binary
    fractions included). wsd decays over ``max(1, round(steps * fraction))`` updates, the first of
    them already below 1; cosine over every update after the warmup."""
    fractions = (0.0, 0.01, 0.1, 0.2, 0.25, 1 / 3, 0.5, 0.9, 1.0) if name == "wsd" else (0.2,)
    for fraction in fractions:
        for floor in (0.0, 0.1, 1 / 3):
            config = LRSchedulerConfig(name=name, warmup_steps=warmup, decay_fraction=fraction, min_lr_ratio=floor)
            for steps in range(warmup + 1 if name == "cosine" else 1, 51):
                curve = [lr_multiplier(s, config, steps) for s in range(steps + 1)]
                decay = min(steps, max(1, round(steps * fraction))) if name == "wsd" else steps - warmup
                where = (name, steps, fraction, floor, curve)
                assert all(v > 0 for v in curve[:steps]), where
                assert curve[steps] == floor, where
                flat = curve[:steps - decay]
                assert all(v == 1.0 for v in flat[warmup:]) and all(0 < v <= 1.0 for v in flat), where
                tail = curve[steps - decay:steps]
                assert all(a > b for a, b in zip(tail, tail[1:])) and tail[0] < 1.0, where
                assert all(v > floor for v in tail), where
                assert tail[0] == pytest.approx(_decayed(name, floor, 1 / (decay + 1)))
                assert tail[-1] == pytest.approx(_decayed(name, floor, decay / (decay + 1)))


def test_the_optimizer_sees_the_schedule_and_a_resumed_scheduler_continues_it():
    """Through ``make_lr_scheduler`` (what the trainers use): the rate each of the 10 updates runs
    with is base * lr_multiplier(step), the last one above 0 with floor 0; a scheduler rebuilt and
    loaded from the state saved after update 6 (through JSON, as checkpoints store it) gives the
    same rates for the remaining updates, also when that state came from an optimizer with a
    second parameter group (an older distillation's fake score at distribution_weight 0)."""
    import json

    from finetune.config import OptimizerConfig
    from finetune.optimization.optim import make_lr_scheduler, make_optimizer

    config = LRSchedulerConfig(name="wsd", warmup_steps=2, decay_fraction=0.5, min_lr_ratio=0.0)

    def fresh(groups=1):
        params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
        optimizer = make_optimizer(params, OptimizerConfig(learning_rate=0.5))
        return optimizer, make_lr_scheduler(optimizer, config, 10)

    def run(optimizer, scheduler, steps):
        used = []
        for _ in range(steps):
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return used

    optimizer, scheduler = fresh()
    whole = run(optimizer, scheduler, 10)
    # warmup 1/2, 1; flat; 5 decay steps at 1 - i/6 (i = 1..5)
    assert whole == pytest.approx([0.25, 0.5, 0.5, 0.5, 0.5, 0.5 * 5 / 6, 0.5 * 4 / 6, 0.25, 0.5 * 2 / 6, 0.5 / 6])
    assert min(whole) > 0 and optimizer.param_groups[0]["lr"] == 0.0  # the floor only after the last update
    for groups in (1, 2):
        optimizer, scheduler = fresh(groups)
        first = run(optimizer, scheduler, 6)
        saved = json.loads(json.dumps(scheduler.state_dict()))
        optimizer, scheduler = fresh()
        scheduler.load_state_dict(saved)
        assert first + run(optimizer, scheduler, 4) == whole, groups
