"""Interrupted runs resume exactly: after ``kill -9`` (from the last checkpoint) and after SIGTERM
(which writes a checkpoint first), the following losses and the final LoRA equal an uninterrupted
run's. Real processes, real signals: the two interrupted runs side by side, forked from one interpreter
(tests/sigkill_runs.py, which then resumes both with the CLI's ``--resume``, side by side)."""

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
from safetensors.torch import load_file

from finetune.config import build_config
from finetune.metrics import read_metrics
from finetune.trainer import train

ROOT = Path(__file__).resolve().parents[1]
# Checkpoints every 4 steps; the kill -9 comes after step 10 (8 is the last checkpoint), SIGTERM after
# step 6: 16 steps leave 6 steps' margin for the kill to land before the run ends.
MAX_STEPS = 16
KILL_AT, TERM_AT = 10, 6


def _config(out: Path, cache: Path) -> dict:
    return {
        "output_dir": str(out),
        "data": {"synthetic": {"num_prompts": 3, "size": 64}, "resolution": 64, "caption_dropout": 0.3, "cache_dir": str(cache)},
        "training": {"max_steps": MAX_STEPS, "batch_size": 2, "gradient_accumulation_steps": 2, "seed": 7},
        # LoRA dropout draws from the global torch generator: resuming must restore it.
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "optimizer": {"learning_rate": 1e-3},
        "lr_scheduler": {"name": "cosine", "warmup_steps": 3},
        "checkpointing": {"every_n_steps": 4, "keep_last": 2},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


pytestmark = pytest.mark.usefixtures("one_thread")


def _losses(out: Path) -> list[float]:
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    return [r["loss"] for r in rows]


def test_resume_after_kill_9_and_after_sigterm_equals_uninterrupted(tmp_path):
    cache = tmp_path / "cache"
    reference = train(build_config(_config(tmp_path / "reference", cache)))
    assert len(reference.losses) == MAX_STEPS and not reference.interrupted
    expected = _losses(tmp_path / "reference")
    expected_lora = load_file(str(tmp_path / "reference" / "lora_diffusers.safetensors"))

    # kill -9: nothing is saved on the way out; resume from the last periodic checkpoint.
    # SIGTERM: a checkpoint at the current step, then exit 130.
    killed, termed = tmp_path / "killed", tmp_path / "termed"
    paths = []
    for out in (killed, termed):
        out.mkdir()
        (out / "config.yaml").write_text(yaml.safe_dump(_config(out, cache)))
        paths.append(str(out / "config.yaml"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "sigkill_runs.py"), "--resume", str(KILL_AT), paths[0],
                           f"{paths[1]}@SIGTERM:{TERM_AT}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    reports = dict(zip((killed, termed), (json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"config"'))))
    assert [r["config"] for r in reports.values()] == paths, done.stdout[-2000:]

    assert reports[killed]["signal"] == signal.SIGKILL, (reports[killed], done.stderr[-3000:])
    assert len(reports[killed]["metrics"]) < MAX_STEPS, "the run finished before it was killed"
    last = max(reports[killed]["checkpoints"])
    assert 8 <= last < MAX_STEPS

    assert reports[termed]["signal"] is None and reports[termed]["code"] == 130, (reports[termed], done.stderr[-3000:])
    stopped = reports[termed]["metrics"][-1]["step"]
    assert stopped < MAX_STEPS and stopped in reports[termed]["checkpoints"]

    for out in (killed, termed):
        # The resumed run (the CLI: exit 0 is finished, not stopped), every step logged once.
        assert reports[out]["resumed"] == 0, (out.name, done.stderr[-4000:])
        torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        lora = load_file(str(out / "lora_diffusers.safetensors"))
        assert lora.keys() == expected_lora.keys()
        for key in lora:
            torch.testing.assert_close(lora[key], expected_lora[key], rtol=1e-5, atol=1e-6)
