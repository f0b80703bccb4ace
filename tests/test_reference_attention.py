"""Bounded-cost style references: "cached" reference attention against its definition (a joint
pass whose mask keeps reference queries on reference keys), computed once per generation;
strength semantics in both modes; the shared reference budget and constant-cost moodboards."""

from __future__ import annotations

import math

import numpy as np
import PIL.Image
import pytest
import torch

from krea2_diffusers.models import layers
from krea2_diffusers.latents import position_ids
from krea2_diffusers.conditioning.references import MAX_MOODBOARD_IMAGES, check_style_inputs
from krea2_diffusers.conditioning.style import moodboard_image, reference_area, reference_size

from conftest import pair_of_transformers

TEXT, GRID, REF_GRIDS = 5, (2, 3), ((2, 2), (1, 3))
pytestmark = pytest.mark.usefixtures("one_thread")


def masked_attention(reference_len):
    """Plain GQA attention in float64 with a full (query, key) mask: the last ``reference_len``
    queries see only the last ``reference_len`` keys (the definition of cached references)."""

    def attend(query, key, value, bias):
        batch, seq, heads, dim = query.shape
        groups = heads // key.shape[2]
        k = key.repeat_interleave(groups, 2).transpose(1, 2)
        v = value.repeat_interleave(groups, 2).transpose(1, 2)
        logits = query.transpose(1, 2) @ k.transpose(-1, -2) / math.sqrt(dim)  # (B, H, S, S_k)
        if bias is not None:
            logits = logits + (bias if bias.dtype != torch.bool else torch.where(bias, 0.0, -math.inf).to(logits))[:, None, None, :]
        if seq == key.shape[1] and seq > reference_len > 0:  # a main block over [text, image, references]
            block = torch.zeros(seq, seq, dtype=torch.bool)
            block[-reference_len:, :-reference_len] = True
            logits = logits.masked_fill(block, -math.inf)
        out = logits.softmax(-1) @ v
        return out.transpose(1, 2).reshape(batch, seq, heads * dim)

    return attend


def inputs(seed=0):
    model, _ = pair_of_transformers(torch.float64)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, GRID[0] * GRID[1], 64, generator=g, dtype=torch.float64)
    text = torch.randn(2, TEXT, 3, 32, generator=g, dtype=torch.float64)
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, 3:] = False  # padded text in the second row
    refs = [torch.randn(1, h * w, 64, generator=g, dtype=torch.float64) for h, w in REF_GRIDS]
    positions = torch.cat([position_ids(TEXT, *GRID)] + [position_ids(0, h, w, first_axis=k) for k, (h, w) in enumerate(REF_GRIDS, 1)])
    return model, hidden, text, mask, torch.cat(refs, 1), positions


def strength_bias(strengths, image_len=GRID[0] * GRID[1]):
    sizes = [h * w for h, w in REF_GRIDS]
    parts = [torch.zeros(TEXT + image_len, dtype=torch.float64)]
    parts += [torch.full((n,), math.log(s), dtype=torch.float64) for n, s in zip(sizes, strengths)]
    return torch.cat(parts)[None].expand(2, -1)


def velocity(model, hidden, cond, t=(0.8, 0.3)):
    with torch.no_grad():
        return model(hidden, timestep=torch.tensor(t, dtype=torch.float64), conditioning=cond).sample


@pytest.mark.parametrize("strengths", [None, (0.5, 2.0)])
def test_cached_equals_joint_with_reference_queries_on_reference_keys(monkeypatch, strengths):
    model, hidden, text, mask, refs, positions = inputs()
    bias = None if strengths is None else strength_bias(strengths)
    with torch.no_grad():
        cached = model.prepare_conditioning(text, positions, mask, reference_hidden_states=refs, key_bias=bias,
                                            reference_attention="cached")
        joint = model.prepare_conditioning(text, positions, mask, reference_hidden_states=refs, key_bias=bias)
    assert cached.reference is None and len(cached.reference_kv) == len(model.transformer_blocks)
    got = velocity(model, hidden, cached)
    unmasked = velocity(model, hidden, joint)
    monkeypatch.setattr(layers, "grouped_attention", masked_attention(refs.shape[1]))
    definition = velocity(model, hidden, joint)
    torch.testing.assert_close(got, definition, rtol=1e-10, atol=1e-10)
    assert (got - unmasked).abs().max() > 1e-4  # the mask matters: cached is not joint


def test_cached_references_run_through_the_blocks_once_per_generation(tiny_pipe):
    lengths = []
    hook = tiny_pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    try:
        out = tiny_pipe("a house", height=32, width=32, num_inference_steps=3, guidance_scale=1.0, output_type="latent",
                        style_images=[picture(1), picture(2)], reference_attention="cached", generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    reference_len, *steps = lengths
    assert len(steps) == 3 and len(set(steps)) == 1  # CFG batched: one pass per step, same length
    assert torch.isfinite(out.images).all()
    # every step saw text + 4 image tokens only; the references' own pass happened once, before
    assert reference_len not in steps


def picture(seed, size=(40, 24)):
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def generate(pipe, **kwargs):
    base = dict(height=32, width=32, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                latents=torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0)))
    return pipe("a house by the sea", **{**base, **kwargs}).images


@pytest.mark.parametrize("mode", ["joint", "cached"])
def test_strength_semantics_in_both_modes(tiny_pipe, mode, monkeypatch):
    plain = generate(tiny_pipe)
    ref = dict(style_images=[picture(1)], reference_attention=mode)
    assert torch.equal(generate(tiny_pipe, style_strengths=[0.0], **ref), plain)  # 0 removes it exactly
    distances = [(generate(tiny_pipe, style_strengths=[s], **ref) - plain).norm().item() for s in (0.2, 1.0, 4.0)]
    assert 0 < distances[0] < distances[1] < distances[2], distances
    # strength 1 everywhere: no float mask reaches attention (SDPA may pick its flash kernels)
    seen = []
    real = layers.grouped_attention
    monkeypatch.setattr(layers, "grouped_attention", lambda q, k, v, bias: seen.append(bias) or real(q, k, v, bias))
    generate(tiny_pipe, style_strengths=[1.0], **ref)
    assert seen and all(bias is None or bias.dtype == torch.bool for bias in seen)


def test_references_share_one_bounded_budget():
    # 10 references on a 512 px target share 512^2 px: at most 1024 latent tokens together
    images = [picture(i, (300 + 20 * i, 200)) for i in range(10)]
    area = reference_area(512, 512, len(images), 512)
    tokens = sum(h * w // 256 for h, w in (reference_size(image, area) for image in images))
    assert 10 <= tokens <= 1024
    assert reference_area(256, 256, 3, 512) == 256 * 256 / 3  # never above the target's own area
    assert reference_area(512, 512, 10, None) == 512 * 512  # unbounded: the target's area each
    with pytest.raises(ValueError, match="style_resolution"):
        reference_area(512, 512, 1, 8)


def test_moodboard_costs_the_same_for_2_and_16_images(tiny_pipe):
    lengths = {}
    for count in (2, 16):
        seen = []
        hook = tiny_pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        try:
            generate(tiny_pipe, style_images=[picture(i) for i in range(count)], style_moodboard=True, style_strengths=0.5)
        finally:
            hook.remove()
        lengths[count] = seen
    assert lengths[2] == lengths[16]
    board = moodboard_image([picture(i) for i in range(5)], 64)
    assert board.size == (64, 64)
    assert check_style_inputs([picture(i) for i in range(16)], 0.5, moodboard=True) == [0.5]


def test_moodboard_limits_are_named():
    with pytest.raises(ValueError, match=f"1 to {MAX_MOODBOARD_IMAGES} images, got none"):
        check_style_inputs([], None, moodboard=True)
    with pytest.raises(ValueError, match=f"at most {MAX_MOODBOARD_IMAGES}"):
        check_style_inputs(["x.png"] * (MAX_MOODBOARD_IMAGES + 1), None, moodboard=True)


def test_cached_reference_images_with_a_lora_equal_the_masked_joint_pass(monkeypatch):
    """kv_cache inference (``reference_attention="cached"``) of a LoRA trained with the mask
    (reference queries on reference keys only) is that masked joint pass, through the whole
    pipeline with reference images (float64: the two differ only by summation order)."""
    from krea2_diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained("tiny-random", torch_dtype=torch.float64)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    lora = {}
    for name, module in pipe.transformer.named_modules():
        if name.startswith("transformer_blocks.") and isinstance(module, torch.nn.Linear):
            lora[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g) * 0.1
            lora[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=g) * 0.1
    pipe.load_lora_weights(lora, adapter_name="masked")
    refs = [picture(1, (48, 32)), picture(2, (16, 48))]
    reference_len = 3 * 2 + 1 * 3  # 48x32 px and 16x48 px: 3 x 2 and 1 x 3 tokens

    def run(attention):
        return pipe("an edit", height=32, width=32, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                    latents=torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
                    reference_images=refs, reference_strengths=[0.5, 2.0], reference_attention=attention).images

    cached, unmasked = run("cached"), run("joint")
    # the mask belongs to the main blocks' attention only (the text fusion's sequences may be as long)
    main, real, masked = [], layers.grouped_attention, masked_attention(reference_len)
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda module, args: main.append(args[0].shape[1]))
    monkeypatch.setattr(layers, "grouped_attention",
                        lambda q, k, v, bias: (masked if main and q.shape[1] == main[-1] else real)(q, k, v, bias))
    definition = run("joint")
    hook.remove()
    torch.testing.assert_close(cached, definition, rtol=1e-10, atol=1e-10)
    assert (cached - unmasked).abs().max() > 1e-4  # the mask matters: cached is not the unmasked joint pass
