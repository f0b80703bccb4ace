"""Interrupted runs resume exactly: after ``kill -9`` (from the last checkpoint) and after SIGTERM
(which writes a checkpoint first), the following losses and the final LoRA equal an uninterrupted
run's. Real subprocesses, real signals (the two interrupted runs side by side: their start-up overlaps)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def _start(config: dict, folder: Path) -> subprocess.Popen:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "finetune", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _signal_at_step(processes: dict, steps: dict, signals: dict, timeout: float = 240) -> None:
    """Send ``signals[out]`` to ``processes[out]`` as soon as the run writing to ``out`` logged
    ``steps[out]`` steps (the runs polled together)."""
    deadline = time.time() + timeout
    waiting = dict(processes)
    while waiting and time.time() < deadline:
        for out, process in list(waiting.items()):
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps[out]:
                process.send_signal(signals[out])
                del waiting[out]
            elif process.poll() is not None:
                pytest.fail(f"training ended before step {steps[out]}:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.005)
    for process in waiting.values():
        process.kill()
    assert not waiting, f"no step {[steps[out] for out in waiting]} within {timeout}s"


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
    processes = {}
    for out in (killed, termed):
        out.mkdir()
        processes[out] = _start(_config(out, cache), out)
    _signal_at_step(processes, {killed: KILL_AT, termed: TERM_AT}, {killed: signal.SIGKILL, termed: signal.SIGTERM})

    processes[killed].wait()
    assert processes[killed].returncode == -signal.SIGKILL
    assert len(read_metrics(killed)) < MAX_STEPS, "the run finished before it was killed"
    last = max(int(p.name.split("-")[1]) for p in (killed / "checkpoints").glob("step-*"))
    assert 8 <= last < MAX_STEPS

    output, _ = processes[termed].communicate(timeout=120)
    assert processes[termed].returncode == 130, output[-2000:]
    stopped = read_metrics(termed)[-1]["step"]
    assert stopped < MAX_STEPS and (termed / "checkpoints" / f"step-{stopped}").is_dir()

    for out in (killed, termed):
        result = train(build_config(_config(out, cache)), resume=True)
        assert not result.interrupted and result.final_step == MAX_STEPS
        torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        lora = load_file(str(out / "lora_diffusers.safetensors"))
        assert lora.keys() == expected_lora.keys()
        for key in lora:
            torch.testing.assert_close(lora[key], expected_lora[key], rtol=1e-5, atol=1e-6)
