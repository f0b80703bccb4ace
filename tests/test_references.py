"""Style references: input checks, CLI syntax, vision-token encoding and cached style descriptions,
on the tiny pipeline's random Qwen3-VL (real tokenizer, tiny vision tower: patch 16, merge 2)."""

from __future__ import annotations

import json
import math

import numpy as np
import PIL.Image
import pytest
import torch

from krea2_diffusers.conditioning import descriptions
from krea2_diffusers.conditioning.text import ASSISTANT_SUFFIX, SYSTEM_PREFIX, encode_prompts, template_counts
from krea2_diffusers.conditioning.descriptions import StyleDescriptionCache, describe_style
from krea2_diffusers.conditioning.references import (
    DEFAULT_MOODBOARD_STRENGTH, IMAGE_PAD, MAX_MOODBOARD_IMAGES, MAX_STYLE_REFERENCES,
    check_style_inputs, encode_prompt_with_images,
    load_reference_images, parse_style_ref, vision_block, vision_inputs,
)

# Small references keep the tiny vision tower cheap: at most 64x64 px = 4 merged tokens per image.
SMALL = 64 * 64
NEW_TOKENS = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def noise_image(seed: int, size=(64, 64), mode="RGB") -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return PIL.Image.fromarray(array[..., 0] if channels == 1 else array, mode)


# ---------------------------------------------------------------------------------------- loading
def test_load_reference_images_from_every_source(tmp_path):
    path = tmp_path / "ref.png"
    noise_image(0).save(path)
    gray = noise_image(1, mode="L")
    tensor_chw = torch.rand(3, 20, 30)
    comfy_batch = torch.rand(2, 16, 24, 3)  # ComfyUI IMAGE: (B, H, W, C) in [0, 1]
    images = load_reference_images([str(path), gray, np.zeros((8, 10, 3), np.uint8), tensor_chw, comfy_batch])
    assert len(images) == 6
    assert all(image.mode == "RGB" for image in images)
    assert np.array_equal(np.asarray(images[0]), np.asarray(noise_image(0)))
    assert images[3].size == (30, 20) and images[4].size == (24, 16)
    assert np.array_equal(np.asarray(images[1])[..., 0], np.asarray(gray))


def test_transparent_pixels_become_white():
    rgba = PIL.Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    (rgb,) = load_reference_images(rgba)
    assert rgb.mode == "RGB" and rgb.getpixel((0, 0)) == (255, 255, 255)


def test_unreadable_and_missing_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"definitely not a png")
    with pytest.raises(ValueError, match="broken.png"):
        load_reference_images([broken])
    with pytest.raises(ValueError, match="missing.jpg"):
        load_reference_images([str(tmp_path / "missing.jpg")])


def test_float_pixels_outside_unit_range_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        load_reference_images([np.full((4, 4, 3), -1.0, np.float32)])


# ------------------------------------------------------------------------------------------ checks
def test_strengths_default_to_one_and_are_validated_before_touching_files():
    paths = ["never/read/a.png", "never/read/b.png"]  # not opened: checks come before any I/O or model work
    assert check_style_inputs(paths, None) == [1.0, 1.0]
    assert check_style_inputs(paths, [0.6, 0]) == [0.6, 0.0]
    assert check_style_inputs(paths, 0.5) == [0.5, 0.5]
    assert check_style_inputs(None, None) == []
    with pytest.raises(ValueError, match="3 style strengths for 2 style images"):
        check_style_inputs(paths, [1, 1, 1])
    with pytest.raises(ValueError, match="1 style strengths for 2 style images"):
        check_style_inputs(paths, [1])
    for bad in (-0.1, math.nan, math.inf, "0.5", True):
        with pytest.raises(ValueError, match="strength"):
            check_style_inputs(paths, [1.0, bad])
    with pytest.raises(ValueError, match="without style_images"):
        check_style_inputs([], [1.0])


def test_too_many_references_and_moodboards():
    many = [f"r{i}.png" for i in range(MAX_STYLE_REFERENCES + 1)]
    with pytest.raises(ValueError, match=f"at most {MAX_STYLE_REFERENCES}"):
        check_style_inputs(many, None)
    assert len(check_style_inputs(many, None, max_references=len(many))) == len(many)
    # A moodboard is one reference (one board image) with one strength for the whole board.
    board = [f"m{i}.png" for i in range(20)]
    assert check_style_inputs(board, None, moodboard=True) == [DEFAULT_MOODBOARD_STRENGTH]
    assert check_style_inputs(board, 0.8, moodboard=True) == [0.8]
    with pytest.raises(ValueError, match="one strength for the whole board"):
        check_style_inputs(board[:2], [0.3, 0.4], moodboard=True)
    with pytest.raises(ValueError, match=f"at most {MAX_MOODBOARD_IMAGES}"):
        check_style_inputs(["x.png"] * (MAX_MOODBOARD_IMAGES + 1), None, moodboard=True)
    # A 4-D array counts as a batch of images.
    assert len(check_style_inputs([torch.zeros(3, 8, 8, 3), "a.png"], None)) == 4


@pytest.mark.parametrize("spec, expected", [
    ("img.png:0.6", ("img.png", 0.6)),
    ("img.png", ("img.png", 1.0)),
    ("C:\\refs\\a.png", ("C:\\refs\\a.png", 1.0)),
    ("C:\\refs\\a.png:0.3", ("C:\\refs\\a.png", 0.3)),
    ("shots/12:30.png", ("shots/12:30.png", 1.0)),
    ("shots/12:30.png:2", ("shots/12:30.png", 2.0)),
    ("a.png:0", ("a.png", 0.0)),
])
def test_parse_style_ref(spec, expected):
    assert parse_style_ref(spec) == expected


@pytest.mark.parametrize("spec", ["", "a.png:-0.5", "a.png:nan", "a.png:inf"])
def test_parse_style_ref_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_style_ref(spec)


# ----------------------------------------------------------------------------------- vision tokens
def test_encode_prompt_with_images_layout_and_groups(tiny_pipe):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    images = [noise_image(0, (64, 64)), noise_image(1, (32, 64)), noise_image(2, (64, 40))]
    embeds, mask, groups = encode_prompt_with_images(te, tok, "a red fox", images, max_pixels=SMALL)
    _, _, tokens = vision_inputs(te, images, max_pixels=SMALL)
    # Rebuild the token sequence independently and find the image placeholders in it.
    ids = tok(SYSTEM_PREFIX + "".join(vision_block(n) for n in tokens) + "a red fox", add_special_tokens=False).input_ids
    ids = ids[template_counts(tok).prefix:] + tok(ASSISTANT_SUFFIX, add_special_tokens=False).input_ids
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    assert embeds.shape == (1, len(ids), 12, te.config.text_config.hidden_size)
    assert mask.shape == (1, len(ids)) and mask.dtype == torch.bool and bool(mask.all())
    assert [end - start for start, end in groups] == tokens and all(n > 0 for n in tokens)
    covered = sorted(i for start, end in groups for i in range(start, end))
    assert covered == [i for i, token in enumerate(ids) if token == pad]
    assert torch.isfinite(embeds).all()
    # Oracle: the encoder's own forward, left to derive the mRoPE positions of one unpadded row itself.
    full = torch.tensor([tok(SYSTEM_PREFIX, add_special_tokens=False).input_ids + ids])
    pixels, grid, _ = vision_inputs(te, images, max_pixels=SMALL)
    with torch.no_grad():
        out = te.model(input_ids=full, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(full == pad).int(),
                       output_hidden_states=True)
    oracle = torch.stack([out.hidden_states[i] for i in tiny_pipe.config.text_encoder_select_layers], dim=2)
    torch.testing.assert_close(embeds, oracle[:, template_counts(tok).prefix:])


def test_no_images_equals_encode_prompts(tiny_pipe):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    embeds, mask, groups = encode_prompt_with_images(te, tok, "a red fox", [])
    expected, expected_mask = encode_prompts(te, tok, ["a red fox"])
    assert groups == []
    assert torch.equal(embeds, expected) and torch.equal(mask, expected_mask)


def test_max_sequence_length_truncates_the_prompt_not_the_images(tiny_pipe):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    long_prompt = "a very long prompt about a lighthouse " * 20
    short, _ = encode_prompts(te, tok, [long_prompt], max_sequence_length=12)
    assert short.shape[1] == 12
    images = np.stack([np.asarray(noise_image(10)), np.asarray(noise_image(11))])  # a (2, H, W, 3) batch
    embeds, _, groups = encode_prompt_with_images(te, tok, long_prompt, images, max_sequence_length=12, max_pixels=SMALL)
    vision = sum(end - start + 2 for start, end in groups)  # pads plus start/end markers
    assert len(groups) == 2 and embeds.shape[1] == vision + 12


def test_image_pixels_reach_the_encoding(tiny_pipe):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    a, _, groups_a = encode_prompt_with_images(te, tok, "a fox", [noise_image(3)], max_pixels=SMALL)
    b, _, groups_b = encode_prompt_with_images(te, tok, "a fox", [noise_image(4)], max_pixels=SMALL)
    start, end = groups_a[0]
    assert groups_a == groups_b
    assert not torch.allclose(a[:, start:end], b[:, start:end])  # the vision tokens carry the pixels
    assert not torch.allclose(a[:, end:], b[:, end:])  # and the prompt tokens see them


# ------------------------------------------------------------------------------ style descriptions
def test_describe_style_is_seeded_clean_and_keeps_global_rng(tiny_pipe):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    state = torch.get_rng_state()
    first = describe_style(te, tok, noise_image(5), seed=0, max_new_tokens=NEW_TOKENS, max_pixels=SMALL)
    again = describe_style(te, tok, noise_image(5), seed=0, max_new_tokens=NEW_TOKENS, max_pixels=SMALL)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == again and first and "<|" not in first and "\n" not in first


def test_description_cache_hits_on_a_repeated_image(tiny_pipe, tmp_path, monkeypatch):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    path = tmp_path / "ref.png"
    noise_image(6).save(path)
    cache = StyleDescriptionCache(tmp_path / "cache" / "styles.json")
    first = cache.describe(te, tok, noise_image(6), max_new_tokens=NEW_TOKENS, max_pixels=SMALL)
    assert (cache.hits, cache.misses) == (0, 1)
    # Same content from a file: a hit, no model call.
    assert cache.describe(te, tok, str(path), max_new_tokens=NEW_TOKENS, max_pixels=SMALL) == first
    assert (cache.hits, cache.misses) == (1, 1)
    # Another seed is another description: a miss.
    cache.describe(te, tok, noise_image(6), seed=1, max_new_tokens=NEW_TOKENS, max_pixels=SMALL)
    assert (cache.hits, cache.misses) == (1, 2)

    # A new process reads the descriptions from disk and never calls the model for them.
    def no_model(*args, **kwargs):
        raise AssertionError("a cached description must not be recomputed")

    monkeypatch.setattr(descriptions, "describe_style", no_model)
    reopened = StyleDescriptionCache(tmp_path / "cache" / "styles.json")
    assert reopened.describe(te, tok, path, max_new_tokens=NEW_TOKENS, max_pixels=SMALL) == first
    assert (reopened.hits, reopened.misses) == (1, 0) and len(reopened) == 2
    assert first in json.loads((tmp_path / "cache" / "styles.json").read_text()).values()
    with pytest.raises(AssertionError):  # a different image still needs the model
        reopened.describe(te, tok, noise_image(7), max_new_tokens=NEW_TOKENS, max_pixels=SMALL)


def test_corrupt_cache_file_is_ignored(tmp_path):
    target = tmp_path / "styles.json"
    target.write_text("{not json")
    assert len(StyleDescriptionCache(target)) == 0


def test_default_on_disk_cache_lives_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KREA2_CACHE", str(tmp_path))
    assert StyleDescriptionCache.on_disk().path == tmp_path / descriptions.STYLE_CACHE_FILE


