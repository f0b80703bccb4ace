"""Two real processes (torchrun, gloo on CPU) give the same training as one process with the same
global batch: FSDP2 for a full fine-tune, DDP for LoRA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune.config import build_config
from finetune.export.writer import model_tensors
from finetune.metrics import read_metrics
from finetune.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def _config(out: Path, cache: Path, method: str, batch_size: int) -> dict:
    return {
        "output_dir": str(out),
        "data": {"synthetic": {"num_prompts": 3, "size": 64}, "resolution": 64, "caption_dropout": 0.5, "cache_dir": str(cache)},
        "training": {"method": method, "max_steps": 4, "batch_size": batch_size, "seed": 3},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"learning_rate": 1e-3, "max_grad_norm": 0.5},  # clipping needs the global norm
        "lr_scheduler": {"name": "cosine", "warmup_steps": 1},
        "parallel": {"strategy": "auto"},  # FSDP2 for full, DDP for LoRA
        "checkpointing": {"every_n_steps": 2, "keep_last": 1},
        # Sampling a sharded model needs every process (FSDP gathers parameters collectively).
        "validation": {"every_n_steps": 4, "prompts": ["red"], "num_inference_steps": 2, "guidance_scale": 2.0,
                       "height": 64, "width": 64},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


pytestmark = pytest.mark.usefixtures("one_thread")


def _torchrun(config: dict, folder: Path) -> str:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "finetune", str(path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_processes_equal_one(tmp_path, method):
    cache = tmp_path / "cache"
    log = _torchrun(_config(tmp_path / "two", cache, method, batch_size=1), tmp_path)
    assert ("strategy fsdp" if method == "full" else "strategy ddp") in log and "2 process(es)" in log
    train(build_config(_config(tmp_path / "one", cache, method, batch_size=2)))

    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two]), torch.tensor([r["loss"] for r in one]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in two]), torch.tensor([r["grad_norm"] for r in one]), rtol=1e-4, atol=1e-6)
    name = "transformer/diffusion_pytorch_model.safetensors" if method == "full" else "lora_diffusers.safetensors"
    weights_two, weights_one = load_file(str(tmp_path / "two" / name)), load_file(str(tmp_path / "one" / name))
    assert weights_two.keys() == weights_one.keys()
    for key in weights_one:
        torch.testing.assert_close(weights_two[key], weights_one[key], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "two" / "samples" / "step-000004" / "raw-00.png").is_file()
    # A DCP checkpoint: every process wrote its own shard file; same tensors as the 1-process run's.
    folder = tmp_path / "two" / "checkpoints" / "step-4"
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert model_tensors(folder) == model_tensors(tmp_path / "one" / "checkpoints" / "step-4")
