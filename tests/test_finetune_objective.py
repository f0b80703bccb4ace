"""Flow-matching objective, LR schedules and the checkpoint file format (no model needed)."""

import math

import pytest
import torch

from finetune import checkpoint as ckpt
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
        assert all(a >= b for a, b in zip(curve[10:], curve[11:])) and curve[-1] == pytest.approx(0.1, abs=0.01)
    else:
        assert curve[10:81] == [1.0] * 71 and all(a > b for a, b in zip(curve[80:], curve[81:]))
        assert curve[-1] == pytest.approx(0.1 + 0.9 / 20)  # reaches the floor as the run ends


def test_checkpoint_round_trip_is_atomic_and_keeps_last_k(tmp_path):
    folder = tmp_path / "checkpoints"
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    for step in (2, 4, 6):
        tmp = ckpt.staging_dir(folder, step)
        tmp.mkdir(parents=True)
        ckpt.write_rng(tmp, 0)
        ckpt.write_main(tmp, model.state_dict(), optimizer.state_dict(), {"step": step, "lr_scheduler": {"x": [1, 2]}})
        ckpt.publish(tmp, step, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [4, 6]
    assert not list(folder.glob(".tmp-*"))
    # A staging folder from a killed save is never mistaken for a checkpoint, and is cleaned up.
    ckpt.staging_dir(folder, 8).mkdir()
    assert ckpt.latest_checkpoint(folder).name == "step-000006"
    ckpt.clean_staging(folder)
    assert not list(folder.glob(".tmp-*"))
    weights, optim_state, state = ckpt.load_checkpoint(folder / "step-000006")
    assert state["step"] == 6 and state["lr_scheduler"] == {"x": [1, 2]}
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    expected = optimizer.state_dict()
    # JSON has no tuples: betas come back as a list, which AdamW accepts alike.
    assert optim_state["param_groups"] == [{**g, "betas": list(g["betas"])} for g in expected["param_groups"]]
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(optim_state["state"][index][key], value)
    ckpt.load_rng(folder / "step-000006", 0)
    first = torch.rand(3)
    ckpt.load_rng(folder / "step-000006", 0)
    assert torch.equal(torch.rand(3), first)  # the generator state was saved and restored
