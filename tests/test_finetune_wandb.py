"""W&B's files go where W&B users expect them: ``$WANDB_DIR/wandb`` when ``WANDB_DIR`` is set, else
``<output_dir>/wandb``; the run's W&B id stays with the run (``<output_dir>/wandb/run-id``), so a
resumed run continues the same W&B run wherever its files are. Offline: nothing leaves the machine."""

from __future__ import annotations

import pytest
import yaml

from krea2_diffusers.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def write_config(tmp_path):
    config = {
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "data": {"synthetic": {"num_prompts": 2, "size": 32}, "resolution": 32, "caption_dropout": 0.0,
                 "num_workers": 0, "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 2, "batch_size": 2},
        "lora": {"rank": 4, "alpha": 4},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False, "wandb": {"project": "krea2-tests", "mode": "offline"}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_wandb_dir_receives_the_wandb_files_and_the_run_keeps_its_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    config, out = write_config(tmp_path), tmp_path / "run"
    assert main(["train", str(config), "--output-dir", str(out)]) == 0
    run_id = (out / "wandb" / "run-id").read_text().strip()
    (offline,) = (tmp_path / "elsewhere" / "wandb").glob("offline-run-*")
    assert offline.name.endswith(f"-{run_id}") and list(offline.glob(f"run-{run_id}.wandb"))
    assert sorted(p.name for p in (out / "wandb").iterdir()) == ["run-id"]  # none of W&B's files in the run

    monkeypatch.delenv("WANDB_DIR")  # unset: beside the run, as before
    assert main(["train", str(config), "--output-dir", str(tmp_path / "plain")]) == 0
    assert list((tmp_path / "plain" / "wandb").glob("offline-run-*/run-*.wandb"))
