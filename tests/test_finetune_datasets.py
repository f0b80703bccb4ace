"""Loss masks, several datasets with their own repeats / buckets / caption rules, regularisation
images weighted by ``training.prior_loss_weight``, and text padded to the batch's longest caption.

The units (mask reading and resizing, the masked loss and its gradient, caption rules, padding) are
checked on their own; one end-to-end run combines every option (train -> checkpoint -> resume ->
validate -> export -> load) on the tiny model."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from finetune.config import ConfigError, build_config
from finetune.data import DatasetError
from finetune.data.cache import TrainingCache, content_hash
from finetune.data.captions import caption_variants, shuffled, with_prefix
from finetune.data.dataset import Sample
from finetune.data.masks import attach_masks, mask_grid, packed_mask, read_mask
from finetune.data.encoding import pack_latents
from finetune.optimization.objective import flow_matching_loss
from finetune.trainer import Trainer
from krea2_diffusers.files import save_safetensors
from krea2_diffusers.loaders.lora import delete_lora

pytestmark = pytest.mark.usefixtures("one_thread")


def _image(path: Path, colour, size=(64, 64)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.broadcast_to(np.array(colour, np.uint8), (size[1], size[0], 3)).copy()).save(path)
    return path


def _half_mask(path: Path, size=(64, 64), split=32) -> Path:
    """White (train) left of column ``split``, black right of it."""
    pixels = np.zeros((size[1], size[0]), np.uint8)
    pixels[:, :split] = 255
    Image.fromarray(pixels, mode="L").save(path)
    return path


# ----------------------------------------------------------------------------- masks
def test_masks_are_read_resized_to_the_latent_grid_and_zero_the_other_halfs_gradient(tmp_path):
    image = _image(tmp_path / "a.png", (200, 10, 10))
    # Grey: the grey level is the weight. Column 36 splits a latent cell (32..39) in half: 0.5 there.
    _half_mask(tmp_path / "a.mask.png", split=36)
    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[..., :3] = 255  # white everywhere: alpha, not the colour, is the weight
    rgba[:16, :, 3] = 255
    _image(tmp_path / "b.png", (0, 0, 0))
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "b.mask.png")
    Image.fromarray(np.full((64, 64), 128, np.uint8), mode="L").save(tmp_path / "c.mask.png")
    assert read_mask(tmp_path / "c.mask.png")[0, 0] == pytest.approx(128 / 255)

    samples = attach_masks([Sample(image, "a", 64, 64), Sample(tmp_path / "b.png", "b", 64, 64),
                            Sample(tmp_path / "none.png", "n", 64, 64)], True)
    assert [s.mask for s in samples] == [tmp_path / "a.mask.png", tmp_path / "b.mask.png", None]
    grid = mask_grid(samples[0], (64, 64))
    assert grid.shape == (8, 8)
    assert torch.equal(grid[:, :4], torch.ones(8, 4)) and torch.equal(grid[:, 5:], torch.zeros(8, 3))
    assert torch.allclose(grid[:, 4], torch.full((8,), 0.5))
    alpha = mask_grid(samples[1], (32, 32))  # the 64 px mask box-filtered to 32 px, then to 4x4 cells
    assert torch.equal(alpha, torch.tensor([1.0, 0.0, 0.0, 0.0])[:, None].expand(4, 4))

    # A mask covering the left half: the loss's gradient w.r.t. the right half's latents (the
    # target x0 and the prediction there) is exactly zero, the left half's is not.
    _half_mask(tmp_path / "a.mask.png", split=32)
    masks = mask_grid(samples[0], (64, 64))[None]
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 8, 8, generator=generator, requires_grad=True)
    pred = torch.randn(1, 16, 64, generator=generator, requires_grad=True)
    noise = torch.randn(1, 16, 64, generator=generator)
    x0 = pack_latents(latents)
    loss = flow_matching_loss(pred, x0, noise, torch.tensor([0.5]), mask=packed_mask(masks, 16))
    loss.backward()
    assert torch.equal(latents.grad[..., 4:], torch.zeros(1, 16, 8, 4)) and latents.grad[..., :4].abs().min() > 0
    right = packed_mask(masks, 16) == 0
    assert right.sum() == 32 * 16 and torch.equal(pred.grad[right], torch.zeros(int(right.sum())))
    # Normalised by the mask's area: the plain mean squared error over the left half.
    error = (pred - (noise - x0)).pow(2).detach()
    torch.testing.assert_close(loss.detach(), error[~right].mean(), rtol=1e-6, atol=0)

    # Checked before any model loads, naming the file.
    Image.new("L", (32, 32), 255).save(tmp_path / "a.mask.png")
    with pytest.raises(DatasetError, match=r"a.mask.png is 32x32 but its image .*a.png is 64x64"):
        attach_masks([Sample(image, "a", 64, 64)], True)
    Image.new("L", (64, 64), 0).save(tmp_path / "a.mask.png")
    with pytest.raises(DatasetError, match="a.mask.png is black"):
        attach_masks([Sample(image, "a", 64, 64)], True)
    with pytest.raises(DatasetError, match="data.masks 'nowhere' is not a folder"):
        attach_masks([Sample(image, "a", 64, 64)], "nowhere")


# ----------------------------------------------------------------------------- captions and padding
def test_caption_rules_and_padding_to_the_batchs_longest_caption(tmp_path):
    assert with_prefix("red, square", "ohwx") == "ohwx, red, square"
    assert with_prefix("ohwx, red", "ohwx") == "ohwx, red" and with_prefix("", "ohwx") == "ohwx"
    tags = "a, b, c, d, e, f"
    orders = {shuffled(tags, 2, random.Random(seed)) for seed in range(40)}
    assert len(orders) > 10 and all(order.startswith("a, b, ") for order in orders)
    assert {frozenset(order.split(", ")) for order in orders} == {frozenset("abcdef")}

    config = build_config({"data": {"datasets": [{"path": "x", "caption_prefix": "ohwx", "shuffle_tags": True, "keep_tags": 1},
                                                 {"path": "y", "caption_prefix": "cls"}]}})
    samples = [Sample(Path("p.png"), tags, 64, 64), Sample(Path("q.png"), "one tag", 64, 64, dataset=1)]
    variants = caption_variants(samples, config.data.datasets, seed=3, epochs=40)
    assert variants == caption_variants(samples, config.data.datasets, seed=3, epochs=40)  # seeded: resume is exact
    assert len(variants[0]) == 16 and len(set(variants[0])) > 10  # at most 16 orders, cycled by epoch
    assert all(v.startswith("ohwx, a, ") for v in variants[0]) and variants[1] == ["cls, one tag"]

    # A batch of captions 3 and 7 tokens long is padded to 7, never to max_sequence_length.
    files = []
    for i, length in enumerate((3, 7)):
        files.append(tmp_path / f"{i}.safetensors")
        save_safetensors({"prompt_embeds": torch.randn(length, 2, 4)}, files[-1])
    save_safetensors({"prompt_embeds": torch.randn(1, 2, 4)}, tmp_path / "empty.safetensors")
    cache = TrainingCache([], files, tmp_path / "empty.safetensors")
    embeds, mask = cache.text([0, 1], [False, False])
    assert embeds.shape == (2, 7, 2, 4) and mask.sum(1).tolist() == [3, 7]
    embeds, mask = cache.text([0, 1], [False, True])
    assert embeds.shape == (2, 3, 2, 4) and mask.sum(1).tolist() == [3, 1]


def test_dataset_config_errors_name_the_key():
    for data, message in (
        ({"path": "x", "datasets": [{"path": "y"}]}, "give data.datasets or data.path"),
        ({"datasets": [{"path": "y", "is_regularization": True}]}, "at least one must hold the images to learn"),
        ({"datasets": [{"path": "y", "keep_tags": -1}]}, r"data.datasets\[0\].keep_tags must be >= 0"),
        ({"datasets": [{"path": "y"}, {"path": "z", "caption_dropout": 1.0}]}, r"data.datasets\[1\].caption_dropout"),
        ({"datasets": [{"path": "y", "repeat": 2}]}, r"did you mean 'data.datasets\[0\].repeats'"),
        ({"datasets": [{"path": "y"}], "repeats": 3}, "give each entry of data.datasets its own repeats"),
        ({"datasets": [{"path": "y"}, {"path": "z", "weight": 0}]}, r"data.datasets\[1\].weight must be a positive number"),
    ):
        with pytest.raises(ConfigError, match=message):
            build_config({"data": data})


# ----------------------------------------------------------------------------- end to end
def _datasets(root: Path) -> dict:
    """A subject set with half masks and tag captions (2 images x 2 repeats, 64 px, weight 2), a second
    set at 48 px (its own buckets) with half caption dropout, and a regularisation set of weight 2 (its
    2 images drawn twice each per epoch: the weighted draws go through the resume below)."""
    for i, colour in enumerate(((220, 30, 30), (30, 30, 220))):
        _image(root / "subject" / f"s{i}.png", colour)
        _half_mask(root / "subject" / f"s{i}.mask.png")
        (root / "subject" / f"s{i}.txt").write_text(f"square, {'red' if i == 0 else 'blue'}, flat, bright, plain")
        _image(root / "other" / f"o{i}.png", (30, 200 - 100 * i, 30))
        (root / "other" / f"o{i}.txt").write_text(f"a green field {i}")
        _image(root / "prior" / f"p{i}.png", (128, 128, 40 + 100 * i))
        (root / "prior" / f"p{i}.txt").write_text("a square")
    return {"masks": True, "resolution": 64, "cache_dir": str(root / "cache"), "num_workers": 0, "datasets": [
        {"path": str(root / "subject"), "repeats": 2, "weight": 2, "caption_prefix": "ohwx", "shuffle_tags": True,
         "keep_tags": 1, "caption_dropout": 0.0},
        {"path": str(root / "other"), "resolution": 48, "caption_dropout": 0.5},
        {"path": str(root / "prior"), "is_regularization": True, "weight": 2, "caption_dropout": 0.0}]}


def test_masks_datasets_regularisation_and_caption_rules_end_to_end(tmp_path, tiny_pipe):
    raw = {"output_dir": str(tmp_path / "run"), "data": _datasets(tmp_path),
           "training": {"max_steps": 6, "batch_size": 2, "seed": 1, "prior_loss_weight": 0.5},
           "lora": {"rank": 4, "alpha": 4}, "optimizer": {"learning_rate": 1e-3},
           "checkpointing": {"every_n_steps": 3, "keep_last": 2},
           "validation": {"prompts": ["ohwx, square"], "num_inference_steps": 2, "height": 64, "width": 64},
           "export": {"formats": ["diffusers", "comfyui"]}, "logging": {"progress_bar": False, "tensorboard": False}}
    first = {**raw, "validation": {}}  # validation may change on resume: sampled once, at the resumed run's end
    trainer = Trainer(build_config(first))
    result = trainer.train()

    # The mix by weight 2:1:2: 4 subject samples (2 x 2 repeats) once each, 2 others once, 2 priors
    # twice each; an epoch of 10 draws, in batches of 2 that fill every bucket.
    mix = json.loads((tmp_path / "run" / "dataset_mix.json").read_text())
    assert [(m["images"], m["repeats"], m["resolution"], m["samples_per_epoch"], m["share"]) for m in mix] == [
        (2, 2, 64, 4, 0.4), (2, 1, 48, 2, 0.2), (2, 1, 64, 4, 0.4)]
    assert {trainer.buckets[i] for i, s in enumerate(trainer.samples) if s.dataset == 1} == {(48, 48)}
    # Captions: the trigger word first, the kept tag next, the rest in a new order in the second epoch.
    captions = trainer.sample_rules.captions
    assert len(captions[0]) == 2 and captions[0][0] != captions[0][1]  # 6 steps x 2 = 12 samples: two epochs of 10
    assert all(c.startswith("ohwx, square, ") for c in captions[0] + captions[2])
    assert captions[4] == ["a green field 0"] and trainer.sample_rules.caption_dropout == [0.0] * 4 + [0.5] * 2 + [0.0] * 2
    assert trainer.sample_rules.sample_weights == [1.0] * 6 + [0.5] * 2
    # Masks cached with the latents: the subject's left half, the others' everywhere.
    latents, masks = trainer.cache.latents_and_masks([0, 7])
    assert torch.equal(masks[0, :, :4], torch.ones(8, 4)) and torch.equal(masks[0, :, 4:], torch.zeros(8, 4))
    assert torch.equal(masks[1], torch.ones(8, 8))
    # The mask is part of its sample's cache key; an unmasked sample keeps the key it always had.
    unmasked_key = [content_hash(trainer.samples[i].image_path.read_bytes(), str(trainer.buckets[i]), "None") for i in (0, 7)]
    assert trainer.cache.latent_files[0].stem != unmasked_key[0] and trainer.cache.latent_files[7].stem == unmasked_key[1]
    seen = set()
    for step in range(6):
        batch = trainer.forward_batch(step)
        seen |= set(batch["ids"])
        expected = torch.tensor([0.5 if i >= 6 else 1.0 for i in batch["ids"]])
        assert torch.equal(batch["sample_weights"], expected) and batch["loss_mask"].shape == batch["x0"].shape
        # Text padded to the batch's longest caption (some row fills every column), never to 512.
        assert batch["mask"].sum(1).max() == batch["embeds"].shape[1] < trainer.config.model.max_sequence_length
    assert seen == set(range(8))

    # Resume from the step-3 checkpoint (as after a kill -9): the same losses, bit for bit.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-6")
    resumed = Trainer(build_config(raw), resume=True).train()
    assert sorted(resumed.losses) == [4, 5, 6] and all(resumed.losses[s] == result.losses[s] for s in (4, 5, 6))
    assert (tmp_path / "run" / "samples" / "step-000006" / "raw-00.png").is_file()  # validated
    assert {p.name for p in resumed.exported} == {"lora_diffusers.safetensors", "lora_comfyui.safetensors"}

    # The exported LoRA loads into an untrained pipeline and reproduces the trained transformer.
    name = tiny_pipe.load_lora_weights(tmp_path / "run" / "lora_diffusers.safetensors", adapter_name="datasets")
    try:
        batch = trainer.forward_batch(0)
        inputs = dict(hidden_states=batch["noise"], encoder_hidden_states=batch["embeds"], timestep=batch["t"],
                      position_ids=batch["positions"], encoder_attention_mask=batch["mask"], return_dict=False)
        with torch.no_grad():
            torch.testing.assert_close(tiny_pipe.transformer(**inputs)[0], trainer.model(**inputs)[0], rtol=1e-4, atol=1e-5)
    finally:
        delete_lora(tiny_pipe.transformer, name)
