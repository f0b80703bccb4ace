"""The checkpoint report (issue 41) on tiny ``krea2 train`` runs: the pinned ``report.json`` of a run
with validation prompts and a trigger word, stopped by SIGTERM as the Train tab stops runs;
``krea2 report`` rebuilding the same file; ``report.html`` in headless chromium; the prompts and
seeds the report samples; a ``transformers`` image model as the encoder; ``metrics: false``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import CHROMIUM, CHROMIUM_ARGS
from finetune.config import ConfigError, build_config
from finetune.report import collector
from finetune.report.plan import plan_for, strip_triggers
from krea2_diffusers.cli import main

PINNED = {"step", "concept", "concept_share", "leak", "copying", "diversity", "seconds"}
STOP_AFTER = 2  # validations before the SIGTERM
EVERY = 4


def write_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        pixels = np.zeros((64, 64, 3), np.uint8)
        pixels[8:56, 8:56] = colour  # a coloured square on black
        Image.fromarray(pixels).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"{name} square")
    return folder


def run_config(root: Path, data: Path, **validation) -> dict:
    return {
        "output_dir": str(root / "run"),
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        # The trigger is the dataset's caption prefix: captions train as "tinytrigger, red square".
        "data": {"datasets": [{"path": str(data), "caption_prefix": "tinytrigger"}],
                 "resolution": 64, "caption_dropout": 0.0, "num_workers": 0, "cache_dir": str(root / "cache")},
        "training": {"method": "lora", "max_steps": 3 * EVERY, "batch_size": 2},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"learning_rate": 3e-3},
        "checkpointing": {"every_n_steps": EVERY, "keep_last": 10},
        "validation": {"every_n_steps": EVERY, "prompts": ["tinytrigger, red square", "blue square"],
                       "num_inference_steps": 2, "guidance_scale": 2.0, "height": 64, "width": 64, **validation},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def train(root: Path, raw: dict) -> int:
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return main(["train", str(path)])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run with validation every 4 steps, stopped by SIGTERM after its second validation."""
    root = tmp_path_factory.mktemp("report")
    measure = collector.ReportCollector.measure
    seen = []

    def measure_then_stop(self, step, *args, **kwargs):
        row = measure(self, step, *args, **kwargs)
        seen.append(step)
        if len(seen) == STOP_AFTER:
            os.kill(os.getpid(), signal.SIGTERM)  # what the Train tab's Stop sends
        return row

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collector.ReportCollector, "measure", measure_then_stop)
        code = train(root, run_config(root, write_dataset(root / "data")))
    torch.set_num_threads(threads)
    return root / "run", code


def test_a_stopped_run_writes_the_pinned_report(stopped):
    run, code = stopped
    assert code == 130  # stopped, with a checkpoint
    report = json.loads((run / "report.json").read_text())
    assert set(report) >= {"checkpoints", "recommended", "encoder"} and report["encoder"] == "qwen3vl"
    rows = report["checkpoints"]
    assert [r["step"] for r in rows] == [EVERY, 2 * EVERY]
    for row in rows:
        assert set(row) >= PINNED
        assert all(isinstance(row[k], float) for k in PINNED - {"step"}), row
        assert -1.0 <= row["copying"] <= 1.0 and 0.0 <= row["concept_share"] <= 1.0 and row["leak"] >= 0.0
        assert row["concept"] <= row["copying"] + 1e-6  # the mean best match cannot pass the largest one
    assert rows[0]["seconds"] < rows[1]["seconds"]
    recommended = report["recommended"]
    assert recommended["step"] in (EVERY, 2 * EVERY) and "concept" in recommended["reason"]
    # One prompt holds the trigger: its samples measure the concept; the other prompt and the first
    # without its trigger measure the leak, each at two seeds, against the base's cached samples.
    measured = [json.loads(line) for line in (run / "report" / "metrics.jsonl").read_text().splitlines()]
    images = measured[0]["images"]
    assert len(images["concept"]) == 1 and len(images["plain"]) == 2 and all(len(g) == 2 for g in images["plain"])
    assert images["concept"][0][0] == f"samples/step-{EVERY:06d}/raw-00.png"  # copy 0: the ordinary sample
    assert all((run / path).is_file() for groups in images.values() for group in groups for path in group)
    assert sorted(p.name for p in (run / "report" / "base").glob("*.png")) == [
        "concept-00-0.png", "concept-00-1.png", "plain-00-0.png", "plain-00-1.png", "plain-01-0.png", "plain-01-1.png"]
    # The ordinary samples folder holds what it always did: one RAW sample per validation prompt.
    assert sorted(p.name for p in (run / "samples" / f"step-{EVERY:06d}").iterdir()) == ["raw-00.png", "raw-01.png"]


def test_krea2_report_rebuilds_the_same_json(stopped, capsys):
    run, _ = stopped
    written = (run / "report.json").read_text()
    (run / "report.json").unlink()
    (run / "report.html").unlink()
    assert main(["report", str(run)]) == 0
    assert (run / "report.json").read_text() == written
    assert (run / "report.html").is_file() and "recommended: step" in capsys.readouterr().out


def test_krea2_report_refuses_a_folder_without_measurements(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no report/reference.json" in capsys.readouterr().err


def test_report_html_opens_offline_with_curves_and_the_marked_checkpoint(stopped):
    from playwright.sync_api import sync_playwright

    run, _ = stopped
    step = json.loads((run / "report.json").read_text())["recommended"]["step"]
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install_browser.sh")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            requested = []
            page.on("request", lambda request: requested.append(request.url))
            page.goto((run / "report.html").as_uri(), wait_until="load")
            for key in ("concept", "concept_share", "leak", "copying", "diversity"):
                assert page.locator(f"svg#curve-{key} polyline").count() == 1, key
                assert page.locator(f"svg#curve-{key} circle").count() == 2, key
            assert page.locator("svg .recommended-marker").count() == 5
            assert page.locator("section.checkpoint.recommended").get_attribute("data-step") == str(step)
            assert page.locator("tr.recommended").get_attribute("data-step") == str(step)
            # Every sample shows, read through relative links from the run folder and nothing else.
            images = page.locator("section.checkpoint img")
            assert images.count() == 6 + 2 * 6  # the base and two checkpoints, 3 prompts x 2 seeds each
            images.last.scroll_into_view_if_needed()
            page.wait_for_function("[...document.images].every(i => i.complete && i.naturalWidth > 0)", timeout=20_000)
            assert all(url.startswith("file://") for url in requested)
        finally:
            browser.close()


def test_the_report_prompts_and_seeds():
    assert strip_triggers("sks, a photo of a dog", ["sks"]) == "a photo of a dog"
    assert strip_triggers("a photo of sks dog, in snow", ["sks"]) == "a photo of dog, in snow"
    assert strip_triggers("a photo of sksdog", ["sks"]) == "a photo of sksdog"  # whole words only
    raw = run_config(Path("run"), Path("data"), seeds_per_prompt=3)
    raw["data"] = {"path": "data"}
    raw["export"]["trigger_words"] = ["tinytrigger"]
    plan = plan_for(build_config(raw))
    assert [(p.kind, p.text, p.validation_index) for p in plan.prompts] == [
        ("concept", "tinytrigger, red square", 0), ("plain", "red square", None), ("plain", "blue square", 1)]
    red, plain_red = plan.prompts[0], plan.prompts[1]
    # The prompt without its trigger samples the seeds of the prompt with it; copy 0 is validation's seed.
    assert [plan.seed_of(red, k) for k in range(3)] == [plan.seed_of(plain_red, k) for k in range(3)] == [0, 1000, 2000]
    assert (plan.prompts[2], 0) not in plan.extra_samples() and (plain_red, 0) in plan.extra_samples()
    raw["validation"]["leak_prompts"] = ["a cat"]
    assert [p.text for p in plan_for(build_config(raw)).plain] == ["a cat"]
    raw["export"]["trigger_words"] = []  # no trigger: the LoRA applies to every prompt
    del raw["validation"]["leak_prompts"]
    assert [p.kind for p in plan_for(build_config(raw)).prompts] == ["concept", "concept"]


def test_validation_metrics_settings_are_checked():
    raw = run_config(Path("run"), Path("data"))
    for change, message in (({"seeds_per_prompt": 0}, "seeds_per_prompt must be >= 1"),
                            ({"prompts": [], "metrics": True}, "validation.metrics needs validation.prompts"),
                            ({"leak_promts": ["x"]}, "leak_prompts"),
                            ({"steps": [3 * EVERY + 1]}, r"validation.steps: step 13 is outside 1..training.max_steps \(12\)")):
        bad = json.loads(json.dumps(raw))
        bad["validation"].update(change)
        with pytest.raises(ConfigError, match=message):
            build_config(bad)


def test_a_transformers_image_model_as_the_encoder_and_metrics_off(tmp_path):
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    encoder = tmp_path / "dinov2-tiny"
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             image_size=32, patch_size=8)).save_pretrained(encoder)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(encoder)
    # No interval: a checkpoint and a validation at the steps listed (a denser grid early in a run), and the last.
    raw = run_config(tmp_path, write_dataset(tmp_path / "data"), encoder=str(encoder), every_n_steps=0, steps=[1])
    raw["training"]["max_steps"] = 3
    raw["checkpointing"] = {"every_n_steps": 0, "keep_last": 10, "steps": [1]}
    assert train(tmp_path, raw) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["encoder"] == str(encoder) and [r["step"] for r in report["checkpoints"]] == [1, 3]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1", "step-3"]

    off = tmp_path / "off"
    off.mkdir()
    raw = run_config(off, write_dataset(off / "data"), metrics=False, every_n_steps=0)
    raw["training"]["max_steps"] = 1
    assert train(off, raw) == 0
    assert not (off / "run" / "report").exists() and not (off / "run" / "report.json").exists()
    assert (off / "run" / "samples" / "step-000001" / "raw-00.png").is_file()


def test_a_resumed_run_continues_its_report_with_the_cached_base(stopped, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(stopped[0], run)
    base = {p.name: p.stat().st_mtime_ns for p in (run / "report" / "base").iterdir()}
    raw = yaml.safe_load((stopped[0].parent / "train.yaml").read_text())
    raw["output_dir"] = str(run)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp_path / "train.yaml"), "--resume"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert [r["step"] for r in report["checkpoints"]] == [EVERY, 2 * EVERY, 3 * EVERY]
    assert {p.name: p.stat().st_mtime_ns for p in (run / "report" / "base").iterdir()} == base  # sampled once per run
    assert report["checkpoints"][2]["seconds"] > report["checkpoints"][1]["seconds"]
