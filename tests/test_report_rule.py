"""The report's recommendation: its rule on hand-made rows, and a deliberately over-trained tiny run
(one image, a high learning rate, 150 steps) whose copying and leak rise and whose recommended
checkpoint comes before the over-trained end.

The tiny-random pipeline cannot show memorisation by itself: its random VAE encodes every image to
almost the same latents (tests/test_finetune_train.py), and its random one-layer vision tower is
blind (a 5% brightness change of an image drops its centred cosine to the original from 1 to 0.24;
the concept of the run below jumps between -0.12 and 0.39 from one checkpoint to the next). So the
run trains on an image the tiny VAE decodes from a smooth latent, with the VAE's encoder swapped
for the exact inverse on that image (the latent it came from), and measures with
``validation.encoder: pixels``: what the LoRA learns is then the training image, pixel for pixel.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import finetune.data.encoding
from finetune.report.metrics import Reference
from finetune.report.recommend import LEAK_BOUND, excesses, recommend
from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.cli import main
from krea2_diffusers.latents import decode_latents

REFERENCE = Reference(near_copy=1.0, base_concept=0.0, base_copying=0.2, base_diversity=1.0, seed_feature=1.0, seed_pixel=0.1)


def rows(concepts, leaks=None, copyings=None):
    leaks = leaks or [0.1] * len(concepts)
    copyings = copyings or [0.3] * len(concepts)
    return [{"step": 10 * (i + 1), "concept": c, "leak": l, "copying": k, "diversity": 0.9}
            for i, (c, l, k) in enumerate(zip(concepts, leaks, copyings))]


def test_the_rule_takes_the_best_admissible_concept():
    # Everything within the bounds: the highest concept, wherever it lies.
    assert recommend(rows([0.1, 0.5, 0.8, 0.85, 0.86]), REFERENCE)["step"] == 50
    assert recommend(rows([0.1, 0.5, 0.86, 0.85, 0.8]), REFERENCE)["step"] == 30
    # Steps 30-50 copy (copying 0.95: 0.94 of the way from the base's 0.2 to a near copy, over 0.9):
    # the best admissible concept is then step 20's.
    copied = recommend(rows([0.1, 0.5, 0.8, 0.85, 0.86], copyings=[0.3, 0.4, 0.95, 0.96, 0.97]), REFERENCE)
    assert copied["step"] == 20 and "step 30 (copying out of bounds" in copied["reason"]
    # Leak over its bound from step 40 on.
    assert recommend(rows([0.1, 0.5, 0.7, 0.85, 0.86], leaks=[0.1, 0.2, 0.3, 0.6, 0.9]), REFERENCE)["step"] == 30
    # Nothing admissible: the checkpoint that exceeds its bounds least.
    worst = recommend(rows([0.5, 0.6], leaks=[0.9, 0.6]), REFERENCE)
    assert worst["step"] == 20 and worst["reason"].startswith("no checkpoint stays within the bounds")
    # No prompt with the trigger: the latest admissible checkpoint.
    assert recommend(rows([None, None, None], leaks=[0.1, 0.2, 0.7]), REFERENCE)["step"] == 20
    assert recommend([], REFERENCE) is None


def spearman(values) -> float:
    """Rank correlation of ``values`` with their order (no ties expected)."""
    ranks = np.argsort(np.argsort(values))
    steps = np.arange(len(values))
    return float(np.corrcoef(ranks, steps)[0, 1])


@pytest.fixture
def one_image(tmp_path, monkeypatch):
    """The training image (decoded by the tiny VAE from a smooth latent) and the swapped encoder."""
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    latent = torch.nn.functional.interpolate(torch.randn(1, 16, 2, 2, generator=torch.Generator().manual_seed(0)), scale_factor=4)
    with torch.no_grad():
        pixels = decode_latents(pipe.vae, latent)[0]
    folder = tmp_path / "data"
    folder.mkdir()
    Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(folder / "fox.png")
    (folder / "fox.txt").write_text("tinytrigger, a photo of a red fox")
    monkeypatch.setattr(finetune.data.encoding, "encode_images", lambda pipe, images: latent.expand(len(images), -1, -1, -1).clone())
    return folder


@pytest.mark.usefixtures("one_thread")
def test_an_overtrained_run_shows_copying_and_leak_rising_and_the_recommendation_comes_before_its_end(tmp_path, one_image):
    steps, every = 150, 15
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "data": {"path": str(one_image), "resolution": 64, "caption_dropout": 0.0, "num_workers": 0,
                 "cache_dir": str(tmp_path / "cache")},
        "training": {"method": "lora", "max_steps": steps, "batch_size": 1},
        "lora": {"rank": 16, "alpha": 16, "train_text_fusion": True, "extra_modules": ["img_in", "final_layer.linear"]},
        "optimizer": {"learning_rate": 6e-3},  # twice the tiny example's rate, on one image
        "lr_scheduler": {"name": "constant"},
        "objective": {"timestep_sampling": "uniform", "shift": "none"},
        "checkpointing": {"every_n_steps": every, "keep_last": 20},
        "validation": {"every_n_steps": every, "prompts": ["tinytrigger, a photo of a red fox"], "num_inference_steps": 4,
                       "guidance_scale": 0.0, "height": 64, "width": 64, "encoder": "pixels"},
        "export": {"trigger_words": ["tinytrigger"], "formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp_path / "train.yaml")]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    checkpoints = report["checkpoints"]
    assert [r["step"] for r in checkpoints] == list(range(every, steps + 1, every))
    leak = [r["leak"] for r in checkpoints]
    copying = [r["copying"] for r in checkpoints]
    print("leak", np.round(leak, 3), "\ncopying", np.round(copying, 3), "\n", report["recommended"])
    # Measured: leak 0.39 -> 0.60 (over its bound from step 105), copying -0.06 -> 0.40, diversity 1.23 -> 0.92
    # (of the base's 1.67), recommended step 90 (75 under the earlier earliest-within-10% rule).
    assert spearman(leak) >= 0.8 and leak[-1] - leak[0] >= 0.15
    assert spearman(copying) >= 0.8 and copying[-1] - copying[0] >= 0.3
    assert checkpoints[-1]["diversity"] < checkpoints[0]["diversity"]
    reference = Reference.from_dict(report["reference"])
    assert max(excesses(checkpoints[-1], reference).values()) > 1.0  # the end is out of bounds ...
    step = report["recommended"]["step"]
    assert step < steps  # ... and the recommendation comes before it, within the bounds
    chosen = next(r for r in checkpoints if r["step"] == step)
    assert chosen["leak"] <= LEAK_BOUND and max(excesses(chosen, reference).values()) <= 1.0
    assert (tmp_path / "run" / "checkpoints" / f"step-{step}").is_dir()  # kept: `krea2 export` takes it
