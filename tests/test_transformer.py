"""Our transformer against diffusers.Krea2Transformer2DModel on identical random weights."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from krea2_diffusers import Krea2Transformer2DModel, convert_diffusers_to_original
from krea2_diffusers.latents import position_ids

from conftest import pair_of_transformers

KEYS = Path(__file__).resolve().parent / "data" / "original_keys.json"  # vendored copy of the released key list


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def inputs(dtype, batch=2, text_len=7, grid=(3, 5), text_layers=3, text_dim=32, pad=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, grid[0] * grid[1], 64, generator=g, dtype=torch.float64).to(dtype)
    text = torch.randn(batch, text_len, text_layers, text_dim, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    if pad:
        mask[-1, text_len // 2:] = False
    timestep = torch.rand(batch, generator=g, dtype=torch.float64).to(dtype)
    return hidden, text, timestep, position_ids(text_len, *grid), mask


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-7), (torch.float32, 1e-5)])
@pytest.mark.parametrize("grid,batch,pad", [((3, 5), 2, True), ((4, 2), 3, True), ((2, 2), 1, False)])
def test_matches_diffusers(dtype, tol, grid, batch, pad):
    ours, theirs = pair_of_transformers(dtype)
    hidden, text, t, pos, mask = inputs(dtype, batch=batch, grid=grid, pad=pad)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = theirs(hidden, text, t, pos, mask).sample
        got = ours(hidden, text, t, pos, mask).sample
    assert got.shape == expected.shape == hidden.shape
    assert got.dtype == dtype
    assert rel_err(got, expected) < tol


def test_prepared_conditioning_equals_full_forward():
    ours, _ = pair_of_transformers(torch.float64)
    hidden, text, t, pos, mask = inputs(torch.float64)
    with torch.no_grad():
        cond = ours.prepare_conditioning(text, pos, mask)
        for step_t in (t, t * 0.5):
            assert torch.equal(ours(hidden, timestep=step_t, conditioning=cond).sample, ours(hidden, text, step_t, pos, mask).sample)


def test_padding_amount_does_not_change_image_tokens():
    """Extra masked padding (the reference's fixed-512 layout) leaves the output unchanged."""
    ours, _ = pair_of_transformers(torch.float64)
    hidden, text, t, pos, mask = inputs(torch.float64, batch=1, pad=False)
    padded = torch.cat([text, torch.randn(1, 9, *text.shape[2:], dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 9, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        short = ours(hidden, text, t, pos, mask).sample
        long = ours(hidden, padded, t, position_ids(padded.shape[1], 3, 5), padded_mask).sample
    assert rel_err(long, short) < 1e-12


def test_text_mask_matters():
    """Guards the mask path: changing a padded token must not matter, changing a real one must."""
    ours, _ = pair_of_transformers(torch.float64)
    hidden, text, t, pos, mask = inputs(torch.float64)
    with torch.no_grad():
        base = ours(hidden, text, t, pos, mask).sample
        edited = text.clone()
        edited[-1, -1] += 5  # padded token of the last row
        assert torch.allclose(ours(hidden, edited, t, pos, mask).sample, base, rtol=0, atol=1e-12)
        edited[-1, 0] += 5  # real token
        assert not torch.allclose(ours(hidden, edited, t, pos, mask).sample[-1], base[-1], atol=1e-6)


def test_bf16_runs_with_fp32_norms():
    ours, theirs = pair_of_transformers(torch.float32)
    ours = ours.to(torch.bfloat16)
    for name, param in ours.named_parameters():
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "norm_q.weight", "norm_k.weight")):
            param.data = param.data.float()
    hidden, text, t, pos, mask = inputs(torch.float32)
    with torch.no_grad():
        got = ours(hidden, text, t, pos, mask).sample
        expected = theirs(hidden, text, t, pos, mask).sample
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), expected) < 5e-2


def test_gradient_checkpointing_same_gradients():
    ours, _ = pair_of_transformers(torch.float64)
    hidden, text, t, pos, mask = inputs(torch.float64)

    def grads():
        ours.zero_grad()
        ours(hidden, text, t, pos, mask).sample.square().sum().backward()
        return {n: p.grad.clone() for n, p in ours.named_parameters()}

    plain = grads()
    ours.enable_gradient_checkpointing()
    checkpointed = grads()
    assert all(torch.allclose(plain[n], checkpointed[n], rtol=1e-10, atol=1e-12) for n in plain)


def test_full_size_names_and_shapes_equal_released_keys():
    released = json.loads(KEYS.read_text())["tensors"]
    with torch.device("meta"):
        model = Krea2Transformer2DModel()
    original = convert_diffusers_to_original(model.state_dict())
    assert {k: list(v.shape) for k, v in original.items()} == released
    assert sum(v.numel() for v in original.values()) == 12_820_073_036


def test_config_keywords_match_diffusers():
    import inspect

    import diffusers

    ours = inspect.signature(Krea2Transformer2DModel.__init__).parameters
    theirs = inspect.signature(diffusers.Krea2Transformer2DModel.__init__).parameters
    assert {k: v.default for k, v in ours.items()} == {k: v.default for k, v in theirs.items()}
    forward = list(inspect.signature(Krea2Transformer2DModel.forward).parameters)
    assert forward[:8] == list(inspect.signature(diffusers.Krea2Transformer2DModel.forward).parameters)
