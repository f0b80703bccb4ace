"""Reference tokens and per-key log-strength bias inside the transformer (no VLM involved)."""

import math

import torch

from krea2_diffusers.latents import position_ids

from conftest import pair_of_transformers

TEXT, GRID, REF_GRID = 6, (3, 4), (2, 3)


def setup(seed=0):
    ours, _ = pair_of_transformers(torch.float64)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, GRID[0] * GRID[1], 64, generator=g, dtype=torch.float64)
    text = torch.randn(2, TEXT, 3, 32, generator=g, dtype=torch.float64)
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, 4:] = False
    ref = torch.randn(2, REF_GRID[0] * REF_GRID[1], 64, generator=g, dtype=torch.float64)
    base_pos = position_ids(TEXT, *GRID)
    ref_pos = torch.cat([base_pos, position_ids(0, *REF_GRID, first_axis=1)])
    return ours, hidden, text, mask, ref, base_pos, ref_pos


def run(model, hidden, t, cond):
    with torch.no_grad():
        return model(hidden, timestep=t, conditioning=cond).sample


def bias_for(strength, n_image, n_ref):
    bias = torch.zeros(2, TEXT + n_image + n_ref, dtype=torch.float64)
    bias[:, TEXT + n_image:] = math.log(strength) if strength > 0 else float("-inf")
    return bias


def test_strength_one_equals_unbiased_joint_attention():
    model, hidden, text, mask, ref, _, ref_pos = setup()
    t = torch.tensor([0.7, 0.3])
    plain = model.prepare_conditioning(text, ref_pos, mask, reference_hidden_states=ref)
    one = model.prepare_conditioning(text, ref_pos, mask, reference_hidden_states=ref, key_bias=bias_for(1.0, 12, 6))
    assert torch.equal(run(model, hidden, t, plain), run(model, hidden, t, one))


def test_strength_zero_removes_the_reference():
    model, hidden, text, mask, ref, base_pos, ref_pos = setup()
    t = torch.tensor([0.7, 0.3])
    without = run(model, hidden, t, model.prepare_conditioning(text, base_pos, mask))
    zero = run(model, hidden, t, model.prepare_conditioning(text, ref_pos, mask, reference_hidden_states=ref, key_bias=bias_for(0.0, 12, 6)))
    torch.testing.assert_close(zero, without, rtol=1e-12, atol=1e-12)


def test_influence_grows_with_strength():
    model, hidden, text, mask, ref, base_pos, ref_pos = setup()
    t = torch.tensor([0.7, 0.3])
    without = run(model, hidden, t, model.prepare_conditioning(text, base_pos, mask))
    distances = []
    for s in (0.01, 0.1, 0.5, 1.0, 3.0):
        cond = model.prepare_conditioning(text, ref_pos, mask, reference_hidden_states=ref, key_bias=bias_for(s, 12, 6))
        distances.append((run(model, hidden, t, cond) - without).norm().item())
    assert all(a < b for a, b in zip(distances, distances[1:])), distances
    assert distances[0] > 0


def test_reference_tokens_are_modulated_as_timestep_zero():
    """The reference's modulation is t = 0 whatever the step's timestep: computed once, reused."""
    model, hidden, text, mask, ref, _, ref_pos = setup()
    cond = model.prepare_conditioning(text, ref_pos, mask, reference_hidden_states=ref)
    _, expected = model._time_modulation(torch.zeros(2), torch.float64)
    assert torch.equal(cond.reference_modulation, expected)
    # and the blocks really use it: a different reference modulation changes the output
    t = torch.tensor([0.7, 0.3])
    shifted = type(cond)(**{**cond.__dict__, "reference_modulation": cond.reference_modulation + 0.1})
    assert not torch.allclose(run(model, hidden, t, cond), run(model, hidden, t, shifted))


def test_reference_positions_use_first_axis():
    pos = position_ids(0, *REF_GRID, first_axis=2)
    assert pos[:, 0].eq(2).all() and pos[-1].tolist() == [2, REF_GRID[0] - 1, REF_GRID[1] - 1]
