"""The proving ground (bench/proving_ground.py, issue 32) in its --quick form: the whole life of a
Krea 2 trained on real digits through the product's own commands, end to end, in one process tree.

Asserts the plumbing (every pinned sample, model and JSON field) and the direction of the cheapest
effect: pretraining beats the scratch-initialised transformer it started from (Frechet distance
to the real held-out digits). Thresholds of the full run are the benchmark's (README, "Proving ground"), not CI's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("base_nocfg", "base", "lora", "lora_off", "dpo", "grpo", "draft", "teacher_4", "teacher_28", "student_4")
KEYS = ("accuracy", "fd", "diversity", "steps", "seconds", "num_inference_steps", "guidance")


def test_quick_run_trains_and_measures_every_stage(tmp_path):
    out, summary_path = tmp_path / "pg", tmp_path / "pg.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # One worker: CI's other pytest worker holds the second core, so a pool only adds its start-up (the
    # pool itself: tests/test_proving_parallel.py; the same rows either way, by construction).
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "proving_ground.py"), "--out", str(out), "--quick",
                           "--workers", "1", "--json", str(summary_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    summary = json.loads(summary_path.read_text())

    per_digit = summary["settings"]["per_digit"]
    for stage in STAGES:
        row = summary["stages"][stage]
        assert all(row[k] is not None for k in KEYS), (stage, row)
        assert 0 <= row["accuracy"] <= 1 and row["fd"] >= 0 and row["diversity"] >= 0, (stage, row)
        folder = out / "samples" / stage
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"{d}_{k}.png" for d in range(10) for k in range(per_digit))
        with Image.open(folder / "7_0.png") as image:
            assert image.mode == "RGB" and image.size == (64, 64)
    assert summary["stages"]["teacher_4"]["num_inference_steps"] == 4 == summary["stages"]["student_4"]["num_inference_steps"]
    assert summary["stages"]["base_nocfg"]["guidance"] == 0 < summary["stages"]["base"]["guidance"]

    # Issue 39's pinned additions: the seed and evaluation seeds, the CFG sweep (one folder per scale),
    # the frontier FD of each post-trained stage, the judge / reward blocks, the user-default LoRAs and the edit.
    assert summary["seed"] == 0 and summary["eval_seeds"]["eval_base"] != summary["eval_seeds"]["settings_tuned_on"]["sampling_base"]
    for point in summary["cfg_sweep"]:
        assert {"guidance", "accuracy", "fd", "diversity"} <= point.keys()
        assert len(list((out / "samples" / "base_cfg" / f"{point['guidance']:.1f}").glob("*.png"))) == 10 * per_digit
    assert len(summary["cfg_sweep"]) >= 6 and summary["cfg_sweep"][0]["guidance"] == 0
    assert all(summary["stages"][s]["frontier_fd"] is not None for s in ("dpo", "grpo", "draft"))
    assert summary["judge"]["heldout_accuracy"] > 0.5 and summary["reward"]["scans_shared_with_judge"] == 0
    assert 0 <= summary["judge"]["attack_transfer"] <= 1
    for stage in ("lora_default", "lora_ema", "lora_off_nocfg"):
        assert len(list((out / "samples" / stage).glob("*.png"))) == 10 * per_digit, stage
    edits = sorted(p.name for p in (out / "samples" / "edit").glob("*.png"))
    assert edits and edits == sorted(p.name for p in (out / "samples" / "edit_source").glob("*.png"))
    # The perfect edit's overlaps (each source scan in red ink): its mask overlaps its own source more
    # than another scan of the digit, and that ratio is the ceiling the edit's is read against.
    edit = summary["edit"]
    assert edit["target_iou_source"] > edit["target_iou_other"] and edit["target_iou_ratio"] > 1
    # The mask analysis (bench/proving/edit_masks.py) reads the run's saved edits and sources and finds the
    # stage's own figure at the stage's mask (it exits non-zero otherwise); a colour-blind mask reads the
    # perfect edit (red ink) as its black source: IoU near 1 where the stage's luminance mask reads 0.89.
    masks_json = tmp_path / "edit_masks.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "proving" / "edit_masks.py"), "--run", str(out),
                           "--summary", str(summary_path), "--json", str(masks_json)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {(r["mask"], r["threshold"]): r for r in json.loads(masks_json.read_text())["0"]}
    assert rows[("luminance", 0.2)]["edit"]["iou_source"] == edit["iou_source"]
    assert rows[("coverage", 0.2)]["target"]["iou_source"] > 0.95 > rows[("luminance", 0.2)]["target"]["iou_source"]

    # Loadable outputs: the base model folder (from krea2 pretrain + krea2 export) and the stage LoRAs.
    from krea2_diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(str(out / "models" / "base"))
    for stage in ("lora", "dpo", "grpo", "draft"):
        pipe.load_lora_weights(str(out / "models" / stage / "lora_diffusers.safetensors"), adapter_name=stage)
    assert (out / "models" / "student_4" / "model_index.json").is_file()
    assert summary["vae"]["judge_accuracy"] is not None and summary["classifier"]["judge_heldout_accuracy"] > 0.5

    # The cheapest effects. Pretraining: the scratch transformer predicts zero velocity, so its samples are
    # decoded noise; a few dozen steps already learn paper and ink where digits are.
    assert summary["stages"]["base"]["fd"] < summary["untrained"]["fd"]
    # The concept LoRA: at this size the base draws red-tinted noise (the quick VAE decodes paper pink;
    # the scratch transformer's redness equals the LoRA's to 0.001), so the concept's direction is the
    # full run's gate (README) and the LoRA learning a prompt's image is tests/test_finetune_train.py's.
    # Here, what cannot happen by chance: each LoRA is loaded (its samples leave the base's at the same
    # noise) and the trigger reaches it (the same noise with and without the trigger gives other images).
    def pixels(stage):
        return np.stack([np.asarray(Image.open(p), np.float32) for p in sorted((out / "samples" / stage).glob("*.png"))])

    base = pixels("base")
    for name in ("lora", "lora_default", "lora_ema"):
        off = pixels(f"{name}_off")
        assert np.abs(off - base).mean() > 1, name
        assert np.abs(pixels(name) - off).mean() > 0, name
    # The concept measure itself, on real scans: every red-ink one counts, no black one does.
    assert summary["classifier"]["concept_measure"] == {"red_heldout_shows": 1.0, "black_heldout_shows": 0.0}

    report = (out / "report.md").read_text()
    assert all(f"grids/{stage}.png" in report for stage in STAGES)
    assert np.isfinite(summary["total_seconds"])
