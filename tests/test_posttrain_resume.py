"""``kill -9`` then ``--resume`` for each post-training method: real processes (forked from one interpreter,
tests/sigkill_runs.py, which then resumes each with the CLI's ``--resume``, the four at once), real SIGKILL.

The killed run logged a few steps past its last checkpoint before it died; the resumed run must
recompute exactly those steps (same loss, same method metrics), then finish and export.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# Checkpoints every 3 steps: killed after step 4 (3 is the last checkpoint), the resumed run redoes step 4
# and ends at the step-6 checkpoint.
MAX_STEPS = 6
KILL_AFTER = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def _configs(tmp: Path) -> dict[str, dict]:
    common = {
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "optimizer": {"learning_rate": 1.0e-3},
        "checkpointing": {"every_n_steps": 3, "keep_last": 2},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    lora = {"training": {"method": "lora", "max_steps": MAX_STEPS, "batch_size": 2, "seed": 3}, "lora": {"rank": 4, "alpha": 4},
            "export": {"formats": ["diffusers"]}}
    return {
        "dpo": {**common, **lora, "output_dir": str(tmp / "dpo"), "method": "dpo",
                "dpo": {"data": str(tmp / "pairs" / "pairs.jsonl"), "synthetic": {"num_pairs": 6, "size": 64},
                        "resolution": 64, "heldout_pairs": 2, "eval_every_n_steps": 3, "sft_weight": 1.0}},
        "grpo": {**common, **lora, "output_dir": str(tmp / "grpo"), "method": "grpo",
                 "grpo": {"prompts": ["a picture", "an image of a thing", "a third"], "group_size": 2, "num_inference_steps": 3,
                          "sde_steps": 2, "resolution": 32, "rewards": [{"function": "posttrain_rewards:brightness"}],
                          "eval_every_n_steps": 0, "pool": {"min_std": 0.0}}},
        # DRaFT with every option on (draft_k 2, LV, CFG, 2 accumulated forwards): the resumed steps redo the same samples.
        "draft": {**common, **lora, "output_dir": str(tmp / "draft"), "method": "draft",
                  "training": {**lora["training"], "activation_checkpointing": "full", "gradient_accumulation_steps": 2},
                  "draft": {"prompts": ["a picture", "an image of a thing", "a third"], "num_inference_steps": 4, "draft_k": 2,
                            "draft_lv": True, "guidance": 1.0, "resolution": 32, "eval_every_n_steps": 3,
                            "rewards": [{"function": "posttrain_rewards:redness"}]}},
        "distill": {**common, "output_dir": str(tmp / "distill"), "method": "distill",
                    "training": {"method": "full", "max_steps": MAX_STEPS, "batch_size": 2, "seed": 3},
                    "export": {"formats": ["original"]},
                    "distill": {"prompts": ["a picture", "a landscape"], "student_steps": 4, "resolution": 32,
                                "distribution_weight": 1.0}},
    }


def test_kill_9_then_resume_continues_each_method_exactly(tmp_path):
    configs = _configs(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    paths = []
    for method, config in configs.items():
        path = tmp_path / f"{method}.yaml"
        path.write_text(yaml.safe_dump(config))
        paths.append(str(path))
    # One interpreter imports once and forks a `python -m finetune.posttrain` run per method, all at
    # once; once all are killed it forks `... --resume` for each, all at once (both cores busy).
    done = subprocess.run([sys.executable, str(TESTS / "sigkill_runs.py"), "--posttrain", "--resume", str(KILL_AFTER), *paths],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"config"')]
    assert [r["config"] for r in reports] == paths, done.stdout[-2000:]
    for method, report in zip(configs, reports):
        assert report["signal"] == signal.SIGKILL, f"{method} was not killed mid-run: {report}\n{done.stderr[-3000:]}"
    for method, report in zip(configs, reports):
        killed_rows = report["metrics"]  # as the killed run left them
        assert len(killed_rows) < MAX_STEPS, f"{method} finished before it was killed"
        last = max(report["checkpoints"])
        assert 3 <= last <= len(killed_rows)
        # The resumed run (the CLI: exit 0 is finished, not stopped, and exported) logged every step once.
        assert report["resumed"] == 0, f"{method}: the resumed run failed\n{done.stderr[-4000:]}"
        out = Path(configs[method]["output_dir"])
        exported = "krea2_original.safetensors" if method == "distill" else "lora_diffusers.safetensors"
        assert (out / exported).is_file(), method
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
        redone = [r["step"] for r in killed_rows if r["step"] > last]
        assert redone, f"{method}: the kill should come after steps that were not checkpointed"
        for before in killed_rows:
            after = rows[before["step"] - 1]
            for key in (k for k in before if k != "step_time"):
                torch.testing.assert_close(torch.tensor(after[key]), torch.tensor(before[key]), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{method} step {before['step']} {key}: {m}")
