"""The EMA's warm-up (``training.ema.warmup``, issue 38) through the user's commands: ``krea2 train
CONFIG`` on the tiny-random model, then ``krea2 export CHECKPOINT OUT --weights ema|raw`` of its
step-200 and step-300 checkpoints, each file loaded into a fresh pipeline.

The effect of a LoRA is how far it moves the pipeline's latents from the base's (same prompts and
noise); the EMA's file must carry at least 0.8 of the trained weights' effect. Without the warm-up
(``warmup: false``, the behaviour before it) the average keeps the zero-initialised B matrices
(``0.999**200`` = 0.82 of their weight after 200 updates) and carries a few percent of it.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from finetune.metrics import read_metrics
from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["red", "blue"]


def write_config(root, name: str, max_steps: int, ema: dict):
    """A run of ``max_steps`` with ``training.ema`` = ``ema`` (its other keys at their defaults),
    checkpoints every 100 steps; returns the YAML file."""
    config = {
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "data": {"synthetic": {"num_prompts": 2, "size": 32}, "resolution": 32, "caption_dropout": 0.0,
                 "num_workers": 0, "cache_dir": str(root / "cache")},
        "training": {"max_steps": max_steps, "batch_size": 2, "seed": 0, "ema": ema},
        "lora": {"rank": 4, "alpha": 4},
        # A rate at which the tiny LoRA learns its target within the run (its effect levels off).
        "optimizer": {"learning_rate": 1e-3},
        "checkpointing": {"every_n_steps": 100, "keep_last": 5},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_run(root, name: str, max_steps: int, ema: dict):
    """``krea2 train`` of :func:`write_config`'s file; returns the run folder."""
    assert main(["train", str(write_config(root, name, max_steps, ema)), "--output-dir", str(root / name)]) == 0
    return root / name


def exported(run, step: int, weights: str):
    out = run / f"export-{step}-{weights}"
    assert main(["export", str(run / "checkpoints" / f"step-{step}"), str(out), "--weights", weights]) == 0
    return out / "lora_diffusers.safetensors"


class Effect:
    """The norm of the change a LoRA file makes to the latents a fresh pipeline generates."""

    def __init__(self):
        self.pipe = Krea2Pipeline.from_pretrained("tiny-random")
        self.pipe.set_progress_bar_config(disable=True)
        self.base = self.latents()

    def latents(self) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
        return self.pipe(PROMPTS, height=32, width=32, num_inference_steps=4, guidance_scale=0.0,
                         generator=generators, output_type="latent").images

    def __call__(self, lora_file) -> float:
        self.pipe.load_lora_weights(lora_file, adapter_name="measured")
        try:
            return float((self.latents() - self.base).norm())
        finally:
            self.pipe.unload_lora_weights()


@pytest.fixture(scope="module")
def ratios(tmp_path_factory):
    """{(warmup, step): EMA effect / trained effect} and the runs' folders by warmup."""
    root = tmp_path_factory.mktemp("ema")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the function-scoped one_thread fixture
    try:
        runs = {True: train_run(root, "warmup", 300, {}),
                False: train_run(root, "no-warmup", 200, {"warmup": False})}
        effect = Effect()
        found = {(warmup, step): effect(exported(run, step, "ema")) / effect(exported(run, step, "raw"))
                 for warmup, run in runs.items() for step in (200, 300) if (run / "checkpoints" / f"step-{step}").exists()}
    finally:
        torch.set_num_threads(threads)
    print("EMA effect / trained effect:", found)
    return found, runs


def test_the_default_warm_up_exports_most_of_what_trained_and_without_it_a_fraction(ratios):
    found, _ = ratios
    assert found[True, 200] >= 0.8 and found[True, 300] >= 0.8, found
    assert found[False, 200] < 0.2, found


def test_metrics_rows_carry_the_decay_of_diffusers_schedule(ratios):
    _, runs = ratios
    rows = read_metrics(runs[True])
    # diffusers' EMAModel: min(decay, (1 + n) / (10 + n)) at the update after n earlier ones.
    expected = [min(0.999, (1 + n) / (10 + n)) for n in range(300)]
    assert [row["ema_decay"] for row in rows] == pytest.approx(expected, rel=1e-12)
    assert {row["ema_decay"] for row in read_metrics(runs[False])} == {0.999}


def test_a_resumed_run_continues_the_warm_up(tmp_path):
    run = train_run(tmp_path, "run", 4, {})
    config = tmp_path / "run.yaml"
    assert main(["train", str(config), "--output-dir", str(run), "--resume", "training.max_steps=6"]) == 0
    # Steps 5 and 6 came after 4 and 5 earlier updates (the step-4 checkpoint's): 5/14 and 6/15.
    assert [row["ema_decay"] for row in read_metrics(run)] == pytest.approx([(1 + n) / (10 + n) for n in range(6)])


def test_runs_recorded_before_the_warm_up_resume_with_warmup_false_only(tmp_path, capsys):
    run = train_run(tmp_path, "run", 2, {"warmup": False})
    # What a run.json written before training.ema.warmup existed looks like: no such key.
    assert "warmup" not in json.loads((run / "run.json").read_text())["fingerprint"]["training"]["ema"]
    config = tmp_path / "run.yaml"
    resume = ["train", str(config), "--output-dir", str(run), "--resume", "training.max_steps=3"]
    assert main([*resume, "training.ema.warmup=true"]) == 2
    assert "training.ema.warmup" in capsys.readouterr().err
    assert main(resume) == 0
    assert [row["ema_decay"] for row in read_metrics(run)] == [0.999] * 3


def test_a_warm_up_shorter_than_the_decay_window_is_refused(tmp_path, capsys):
    config = write_config(tmp_path, "run", 10, {"decay": 0.99, "warmup": 98})
    assert main(["train", str(config), "--output-dir", str(tmp_path / "run")]) == 2
    assert "training.ema.warmup=98: a warm-up reaching decay 0.99 must last at least 99 steps" in capsys.readouterr().err
    # 99 steps (k = 1: a running mean until then) is the shortest, and with every_n_steps 2, twice that.
    assert main(["train", str(config), "--output-dir", str(tmp_path / "run"), "--dry-run",
                 "training.ema.warmup=99"]) == 0
    assert main(["train", str(config), "--output-dir", str(tmp_path / "run"), "--dry-run",
                 "training.ema={decay: 0.99, warmup: 197, every_n_steps: 2}"]) == 2
