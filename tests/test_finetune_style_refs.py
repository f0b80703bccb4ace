"""Style-reference LoRA training (``data.style_references``) on the tiny-random pipeline.

Two style groups of synthetic textures (warm reds, cool blues; one subfolder each), ALL with the
same caption, so the only thing that tells a sample's group is its references. As in
``test_finetune_train.py`` the VAE encoder is swapped for a fixed pooling map (the tiny random VAE
maps every image to nearly the same latents), both for the training cache and for the pipeline's
reference latents; the effect is measured in latent space on images sampled by the real pipeline
with ``style_images`` and the exported LoRA file, against held-out reference images.
"""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest
import torch

import finetune.data.encoding
import krea2_diffusers.conditioning.style
from finetune.config import ConfigError, build_config
from finetune.data import DatasetError
from finetune.data.dataset import scan_dataset
from finetune.data.style_groups import StyleGroups
from finetune.engine.loader import step_generator
from finetune.trainer import Trainer
from krea2_diffusers import Krea2Pipeline

from test_finetune_train import pooled_latents

CAPTION = "a texture"
GROUPS = {"warm": [(0.9, 0.15, 0.1), (0.8, 0.3, 0.1), (0.95, 0.1, 0.3), (0.7, 0.2, 0.2)],
          "cool": [(0.1, 0.2, 0.9), (0.1, 0.4, 0.8), (0.3, 0.1, 0.9), (0.2, 0.3, 0.7)]}
HELD_OUT = {"warm": (0.85, 0.25, 0.15), "cool": (0.15, 0.3, 0.85)}
SIZE, STEPS = 64, 120
pytestmark = pytest.mark.usefixtures("one_thread")


def texture(colour, seed) -> PIL.Image.Image:
    """A flat colour with fine pixel noise (a "texture" whose 8x8 pools keep the colour)."""
    noise = np.random.default_rng(seed).uniform(-0.08, 0.08, (SIZE, SIZE, 3))
    return PIL.Image.fromarray((np.clip(np.array(colour) + noise, 0, 1) * 255).astype("uint8"))


def write_groups(root):
    for name, colours in GROUPS.items():
        (root / name).mkdir(parents=True)
        for i, colour in enumerate(colours):
            texture(colour, i).save(root / name / f"{i}.png")
            (root / name / f"{i}.txt").write_text(CAPTION)
    return root


def config(root, **style) -> dict:
    return {
        "output_dir": str(root / "run"),
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "data": {"path": str(root / "data"), "resolution": SIZE, "caption_dropout": 0.0, "num_workers": 0,
                 "style_references": {"enabled": True, "max_references": 2, "strength_range": [0.5, 1.0], **style}},
        "training": {"method": "lora", "max_steps": STEPS, "batch_size": 4, "seed": 0},
        "lora": {"rank": 8, "alpha": 8, "extra_modules": ["img_in", "final_layer.linear"]},
        "optimizer": {"learning_rate": 3e-3},
        "lr_scheduler": {"name": "wsd", "warmup_steps": 10, "decay_fraction": 0.3},
        "objective": {"timestep_sampling": "uniform", "shift": "none"},
        "checkpointing": {"every_n_steps": 1000, "keep_last": 1},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


@pytest.fixture(scope="module", params=["joint", "cached"])
def trained(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("style_refs")
    write_groups(root / "data")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune.data.encoding, "encode_images", pooled_latents)
        trainer = Trainer(build_config(config(root, attention=request.param)))
        result = trainer.train()
    torch.set_num_threads(threads)
    return root, trainer, result


def _sample(pipe, references, seed, attention):
    return pipe(CAPTION, height=SIZE, width=SIZE, num_inference_steps=8, guidance_scale=0.0, style_images=references,
                style_strengths=[1.0] * len(references), generator=torch.Generator().manual_seed(seed),
                reference_attention=attention, output_type="latent").images[0]


def _margins(pipe, held_out, targets, attention, seeds=(0, 1)):
    """Per group g: mean over seeds of  mse(sample | refs of g, other group) - mse(sample | refs of g, g)."""
    margins = {}
    for name, other in (("warm", "cool"), ("cool", "warm")):
        samples = [_sample(pipe, [held_out[name]], seed, attention) for seed in seeds]
        margins[name] = float(sum(((s - targets[other]) ** 2).mean() - ((s - targets[name]) ** 2).mean() for s in samples) / len(seeds))
    return margins


def test_style_lora_moves_samples_toward_the_referenced_group(trained, monkeypatch):
    root, trainer, result = trained
    held_out = {name: texture(colour, 99) for name, colour in HELD_OUT.items()}
    samples = trainer.samples
    latents = finetune.data.encoding.pack_latents(torch.cat([trainer.cache.latents([i]) for i in range(len(samples))]))
    targets = {name: latents[[i for i, s in enumerate(samples) if s.style_id == name]].mean(0) for name in GROUPS}
    monkeypatch.setattr(krea2_diffusers.conditioning.style, "encode_images", pooled_latents)  # reference latents as cached

    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    attention = trainer.config.data.style_references.attention
    base = _margins(pipe, held_out, targets, attention)
    pipe.load_lora_weights(result.output_dir / "lora_diffusers.safetensors")
    learned = _margins(pipe, held_out, targets, attention)
    gap = float(((targets["warm"] - targets["cool"]) ** 2).mean())
    print(f"{attention}: group gap {gap:.4f}; margin (d_other - d_referenced) base {base}, trained {learned}")
    for name in GROUPS:
        assert learned[name] > 0.25 * gap, f"{name}: samples are not closer to the referenced group"
        assert learned[name] > base[name] + 0.25 * gap, f"{name}: the LoRA adds no pull toward the referenced group"


def test_a_reference_is_never_the_target(trained):
    _, trainer, _ = trained
    seen = 0
    for step in range(12):
        batch = trainer.forward_batch(step)
        assert batch["references"].shape[0] == len(batch["ids"])
        for target, references in zip(batch["ids"], batch["reference_ids"]):
            for ref in references:
                seen += 1
                assert trainer.samples[ref].image_path != trainer.samples[target].image_path
                assert trainer.samples[ref].style_id == trainer.samples[target].style_id
    assert seen > 48


def test_groups_exclude_repeats_of_the_target_and_draws_are_deterministic(tmp_path):
    scan = scan_dataset(write_groups(tmp_path / "data"))
    samples = scan.samples * 2  # data.repeats: the same image twice must not reference itself
    groups = StyleGroups(samples, build_config(config(tmp_path, max_references=3)).data.style_references)
    ids = list(range(len(samples)))
    first = groups.draw(ids, step_generator(0, 5))
    assert first == groups.draw(ids, step_generator(0, 5))
    for index in range(30):
        references, strengths = groups.draw(ids, step_generator(0, index))
        for i, (refs, s) in enumerate(zip(references, strengths)):
            assert len(set(refs)) == len(refs) and 1 <= len(refs) <= 3
            assert all(samples[j].image_path != samples[i].image_path and samples[j].style_id == samples[i].style_id for j in refs)
            assert all(0.5 <= v <= 1.0 for v in s)


def test_a_manifest_style_id_column_makes_the_groups(tmp_path):
    write_groups(tmp_path)
    rows = [{"path": f"{name}/{i}.png", "caption": CAPTION, "style_id": name} for name in GROUPS for i in range(len(GROUPS[name]))]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    samples = scan_dataset(tmp_path / "m.jsonl").samples
    groups = StyleGroups(samples, build_config(config(tmp_path)).data.style_references)
    assert [samples[j].style_id for j in groups.others[0]] == ["warm"] * (len(GROUPS["warm"]) - 1)


def test_bad_style_reference_setups_fail_before_training(tmp_path):
    with pytest.raises(ConfigError, match="style_references.bogus"):
        build_config(config(tmp_path, bogus=1))
    with pytest.raises(ConfigError, match="strength_range"):
        build_config(config(tmp_path, strength_range=[0.0, 1.0]))
    with pytest.raises(ConfigError, match="attention"):
        build_config(config(tmp_path, attention="full"))
    (tmp_path / "flat").mkdir()
    texture(GROUPS["warm"][0], 0).save(tmp_path / "flat" / "a.png")
    (tmp_path / "flat" / "a.txt").write_text(CAPTION)
    settings = build_config(config(tmp_path)).data.style_references
    with pytest.raises(DatasetError, match="a.png has none"):
        StyleGroups(scan_dataset(tmp_path / "flat").samples, settings)
    (tmp_path / "one" / "solo").mkdir(parents=True)
    texture(GROUPS["warm"][0], 0).save(tmp_path / "one" / "solo" / "a.png")
    (tmp_path / "one" / "solo" / "a.txt").write_text(CAPTION)
    with pytest.raises(DatasetError, match="'solo' has only one image"):
        StyleGroups(scan_dataset(tmp_path / "one").samples, settings)
