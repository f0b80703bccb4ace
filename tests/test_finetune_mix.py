"""Issue 38, through ``krea2 train`` on YAML files a user writes: regularisation images drawn by the
datasets' ``weight`` (not by their sizes), counted by ``--dry-run`` over an epoch of the run's own batch
order; relative paths in a YAML config resolved against the config file's directory, whatever the
working directory (a hub id stays a hub id)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from finetune.config_paths import NOTE
from krea2_diffusers.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def captioned_images(folder: Path, count: int, caption: str, size: int = 16) -> Path:
    folder.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(np.full((size, size, 3), (7 * i) % 256, np.uint8)).save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(caption)
    return folder


def shares(printed: str) -> dict[str, float]:
    """``dataset PATH: S% of samples`` lines -> {path: S}."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^dataset (.+?): ([\d.]+)% of samples", printed, flags=re.M)}


def test_regularisation_is_drawn_by_weight_not_by_size(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    captioned_images(project / "subject", 20, "ohwx dog")
    captioned_images(project / "class", 200, "a photo of a dog")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the config's relative paths are the config's, not this folder's
    subject, prior = str(project / "subject"), str(project / "class")

    def dry_run(name: str, subject_entry: dict) -> dict[str, float]:
        config = {"output_dir": name, "model": {"pretrained_model_name_or_path": "tiny-random"},
                  "data": {"resolution": 16, "datasets": [{"path": "subject", **subject_entry},
                                                          {"path": "class", "is_regularization": True}]}}
        (project / f"{name}.yaml").write_text(yaml.safe_dump(config))
        assert main(["train", f"../project/{name}.yaml", "--dry-run"]) == 0
        out, err = capsys.readouterr()
        assert NOTE in err and f"data.datasets[0].path: {subject}" in err
        assert (project / name / "dry-run.log").is_file() and not (elsewhere / name).exists()
        return shares(out)

    # Defaults: 20 subject beside 200 class images train half and half (by size it was 9% : 91%).
    drawn = dry_run("equal", {})
    assert set(drawn) == {subject, prior} and 40 <= drawn[subject] <= 60 and drawn[subject] + drawn[prior] == pytest.approx(100)
    # weight 3 : 1 -> three quarters of the samples are the subject's; repeats do not change the share.
    assert 72 <= dry_run("three", {"weight": 3})[subject] <= 78
    assert 72 <= dry_run("repeated", {"weight": 3, "repeats": 4})[subject] <= 78


def test_a_yaml_with_relative_paths_trains_from_another_directory(tmp_path, monkeypatch, capsys, recwarn):
    from krea2_diffusers.models.tiny import save_random_original_file, tiny_transformer_config

    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    save_random_original_file(project / "models" / "raw.safetensors", tiny_transformer_config())
    captioned_images(project / "images", 2, "a red square", size=32)
    config = {"output_dir": "run",
              "model": {"pretrained_model_name_or_path": "models/raw.safetensors", "text_encoder": "tiny-random",
                        "vae": "tiny-random"},
              "data": {"path": "images", "resolution": 32, "caption_dropout": 0.0, "num_workers": 0, "cache_dir": "cache"},
              "training": {"max_steps": 2, "batch_size": 2}, "lora": {"rank": 4, "alpha": 4},
              "checkpointing": {"every_n_steps": 2}, "export": {"formats": ["diffusers"]},
              "logging": {"progress_bar": False, "tensorboard": False}}
    (project / "train.yaml").write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    assert main(["train", "../project/train.yaml"]) == 0
    # A one-process run's checkpoints do not repeat torch's "assuming the intent is to save in a single process".
    assert not [str(w.message) for w in recwarn if "single process" in str(w.message)]
    out, err = capsys.readouterr()
    assert NOTE in err and f"model.pretrained_model_name_or_path: {project / 'models' / 'raw.safetensors'}" in err
    assert out.strip().splitlines()[-1] == str(project / "run" / "lora_diffusers.safetensors")
    run = json.loads((project / "run" / "run.json").read_text())["config"]
    assert (run["model"]["pretrained_model_name_or_path"], run["data"]["path"], run["data"]["cache_dir"]) == (
        str(project / "models" / "raw.safetensors"), str(project / "images"), str(project / "cache"))
    assert list(elsewhere.iterdir()) == []
    # An override on the command line is the shell's path (this folder's); a hub id is no path at all.
    from finetune.config import load_config

    (project / "hub.yaml").write_text("model: {pretrained_model_name_or_path: krea/Krea-2-Raw}\ndata: {path: images}\n")
    loaded = load_config(project / "hub.yaml", ["output_dir=mine"])
    assert (loaded.model.pretrained_model_name_or_path, loaded.data.path, loaded.output_dir) == (
        "krea/Krea-2-Raw", str(project / "images"), "mine")
    # The note names what the file's paths became, not a key the command line replaced (--output-dir).
    capsys.readouterr()
    load_config(project / "train.yaml", ["output_dir=mine"])
    err = capsys.readouterr().err
    assert f"data.path: {project / 'images'}" in err and "output_dir:" not in err
