"""Two real processes (torchrun, gloo on CPU) give the same training as one process with the same
global batch: FSDP2 for a full fine-tune, DDP for LoRA (with 4 accumulated micro-batches per
step, which communicate once: a DDP communication hook counts the gradient all-reduces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.config import build_config
from finetune.export.writer import model_tensors
from finetune.metrics import read_metrics
from finetune.trainer import train
from launcher import launch

STEPS = 4

# `python -m finetune` with a DDP-wrapped model given a comm hook that counts its bucket
# all-reduces (then runs DDP's default all-reduce), written to PROBE_DIR/rank<R>-allreduce.json.
# DDP prepares the reduction in the forward: `no_sync` must wrap forward and backward.
COUNT_ALL_REDUCES = '''
import atexit, json, os, sys
import torch
import finetune.trainer as trainer
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

calls = []
wrap = trainer.wrap_model

def counted(*args, **kwargs):
    model = wrap(*args, **kwargs)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        def hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)
        model.register_comm_hook(None, hook)
    return model

trainer.wrap_model = counted
atexit.register(lambda: json.dump(calls, open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}-allreduce.json"), "w")))
from finetune.cli import main
sys.exit(main())
'''


def _config(out: Path, cache: Path, method: str, batch_size: int, accumulation: int = 1) -> dict:
    return {
        "output_dir": str(out),
        "data": {"synthetic": {"num_prompts": 3, "size": 64}, "resolution": 64, "caption_dropout": 0.5, "cache_dir": str(cache)},
        "training": {"method": method, "max_steps": STEPS, "batch_size": batch_size, "seed": 3,
                     "gradient_accumulation_steps": accumulation},
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


@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_processes_equal_one(tmp_path, method):
    cache = tmp_path / "cache"
    accumulation = 4 if method == "lora" else 1
    probe = tmp_path / "probe.py"
    probe.write_text(COUNT_ALL_REDUCES)
    done = launch(_config(tmp_path / "two", cache, method, batch_size=1, accumulation=accumulation), tmp_path, 2, [str(probe)])
    log = done.stdout + done.stderr
    assert ("strategy fsdp" if method == "full" else "strategy ddp") in log and "2 process(es)" in log
    train(build_config(_config(tmp_path / "one", cache, method, batch_size=2, accumulation=accumulation)))
    if method == "lora":
        for rank in range(2):  # one bucket (the LoRA's gradients are small), one all-reduce per optimizer step
            calls = json.loads((tmp_path / f"rank{rank}-allreduce.json").read_text())
            assert set(calls) == {0} and len(calls) == STEPS, (rank, calls)  # not STEPS * accumulation

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
