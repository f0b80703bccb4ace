"""Training a model too large to copy per process: a medium (~170 MB fp32) original-layout file
made on the fly, with the tiny text encoder and VAE.

* full fine-tune with 2 real processes (torchrun, gloo): each rank's memory while the transformer
  is set up stays near half the fp32 size (measured: RSS sampled in the rank), the losses equal a
  1-process run's, the checkpoint is a DCP folder with one shard file per rank, and resuming it
  with 1 process continues with the same losses;
* LoRA on an fp8-stored base: about a quarter of the fp32 bytes, learns like the bf16 base, and
  the exported LoRA loads into a plain bf16 pipeline;
* ``--dry-run`` prints a plan and trains nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.config import build_config
from finetune.export.writer import model_tensors
from finetune.metrics import read_metrics
from finetune.trainer import Trainer
from krea2_diffusers.models.tiny import proportioned_transformer_config, save_random_original_file
from launcher import launch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

# Runs the trainer with the transformer set-up wrapped in a probe (RSS sampled every 2 ms from a
# thread, see HostPeak), written as {"rank", "growth"} bytes to PROBE_DIR/rank<R>.json.
PROBE = '''
import json, os, sys
import finetune.model as model
from finetune.engine.plan import HostPeak

build = model.build_sharded_transformer

def probed(config, runtime):
    with HostPeak() as probe:
        result = build(config, runtime)
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{runtime.rank}.json"), "w") as f:
        json.dump({"rank": runtime.rank, "growth": probe.growth}, f)
    return result

model.build_sharded_transformer = probed
from finetune.cli import main
sys.exit(main())
'''


@pytest.fixture(scope="module")
def medium_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("medium")
    path = folder / "krea2_medium.safetensors"
    size = save_random_original_file(path, proportioned_transformer_config(), seed=0)
    return path, size


def _config(out: Path, cache: Path, model: Path, **training) -> dict:
    return {
        "output_dir": str(out),
        "model": {"pretrained_model_name_or_path": str(model), "text_encoder": "tiny-random", "vae": "tiny-random"},
        "data": {"synthetic": {"num_prompts": 2, "size": 32}, "resolution": 32, "caption_dropout": 0.0,
                 "cache_dir": str(cache), "num_workers": 0},
        "training": {"method": "full", "max_steps": 4, "batch_size": 1, "seed": 5, **training},
        "optimizer": {"learning_rate": 1e-4, "max_grad_norm": 1.0},
        "checkpointing": {"every_n_steps": 2, "keep_last": 1},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def _run(config: dict, folder: Path, processes: int, *args: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / "probe.py"
    probe.write_text(PROBE)
    done = launch(config, folder, processes, [str(probe)], *args)
    return done.stdout + done.stderr


def _setup_growth(folder: Path, processes: int) -> list[int]:
    return [json.loads((folder / f"rank{r}.json").read_text())["growth"] for r in range(processes)]


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out)]


def test_sharded_full_finetune_memory_losses_and_resume_on_another_world_size(tmp_path, medium_file):
    model, fp32_bytes = medium_file
    cache = tmp_path / "cache"
    # Reference: one process, the same global batch of 2, four steps.
    one = tmp_path / "one"
    _run(_config(one / "run", cache, model, batch_size=2), one, 1)
    reference = _losses(one / "run")
    assert len(reference) == 4
    (one_growth,) = _setup_growth(one, 1)

    # Two processes, each 1 sample per step, stopped after step 2 (its checkpoint).
    two = tmp_path / "two"
    log = _run(_config(two / "run", cache, model, max_steps=2), two, 2)
    assert "strategy fsdp" in log and "2 process(es)" in log
    growth = _setup_growth(two, 2)
    # Each rank holds half of the fp32 weights, and reads them slice by slice: its memory grows by
    # about half the model while setting up, where the single process grows by all of it.
    assert one_growth > 0.9 * fp32_bytes, (one_growth, fp32_bytes)
    for rank_growth in growth:
        assert rank_growth < 0.65 * fp32_bytes, (growth, fp32_bytes)
    torch.testing.assert_close(torch.tensor(_losses(two / "run")), torch.tensor(reference[:2]), rtol=1e-5, atol=1e-6)

    checkpoint = two / "run" / "checkpoints" / "step-2"
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert set(model_tensors(checkpoint)) == set(model_tensors(one / "run" / "checkpoints" / "step-4"))

    # Resume the 2-process checkpoint with 1 process: the same global batch, the same losses.
    _run(_config(two / "run", cache, model, max_steps=4), two, 1, "--resume")
    torch.testing.assert_close(torch.tensor(_losses(two / "run")), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    from safetensors.torch import load_file

    resumed = load_file(str(two / "run" / "transformer" / "diffusion_pytorch_model.safetensors"))
    expected = load_file(str(one / "run" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert resumed.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=1e-4, atol=1e-5)

    # `krea2 export` on its own: the original layout in bf16, loadable as a single file.
    from krea2_diffusers import Krea2Transformer2DModel
    from krea2_diffusers.cli import main as krea2

    exported = tmp_path / "exported"
    assert krea2(["export", str(two / "run" / "checkpoints" / "step-4"), str(exported), "--format", "original",
                  "--dtype", "bfloat16"]) == 0
    loaded = Krea2Transformer2DModel.from_single_file(str(exported / "krea2_original.safetensors")).state_dict()
    assert loaded.keys() == resumed.keys()
    for key in resumed:
        assert torch.equal(loaded[key], resumed[key].bfloat16()), key
    assert krea2(["export", str(two / "run" / "checkpoints" / "step-4"), str(exported)]) == 2  # nothing overwritten


def _fixed_batch_loss(pipe, trainer: Trainer, lora_file: Path | None) -> float:
    """Flow-matching loss of a plain bf16 pipeline (optionally with a LoRA file loaded) on fixed
    noise and times over the training samples: measured outside the trainer."""
    from finetune.objective import add_noise, flow_matching_loss

    if lora_file is not None:
        pipe.load_lora_weights(lora_file, adapter_name="trained")
    generator = torch.Generator().manual_seed(123)
    losses = []
    with torch.no_grad():
        for step in range(2):
            batch = trainer.forward_batch(step)
            noise = torch.randn(batch["x0"].shape, generator=generator)
            t = torch.full((batch["x0"].shape[0],), 0.5)
            pred = pipe.transformer(hidden_states=add_noise(batch["x0"], noise, t).bfloat16(),
                                    encoder_hidden_states=batch["embeds"].bfloat16(), timestep=t,
                                    position_ids=batch["positions"], encoder_attention_mask=batch["mask"], return_dict=False)[0]
            losses.append(float(flow_matching_loss(pred, batch["x0"], noise, t)))
    pipe.unload_lora_weights()
    return sum(losses) / len(losses)


def test_lora_on_fp8_base_is_a_quarter_of_fp32_learns_like_bf16_and_exports_for_bf16(tmp_path, medium_file):
    model, fp32_bytes = medium_file
    cache = tmp_path / "cache"
    runs = {}
    for quantize in ("none", "fp8"):
        config = _config(tmp_path / quantize, cache, model, method="lora", max_steps=12, batch_size=2)
        config["model"].update(dtype="bfloat16", quantize=quantize)
        config["lora"] = {"rank": 8, "alpha": 8}
        config["optimizer"]["learning_rate"] = 4e-3
        config["checkpointing"]["every_n_steps"] = 0
        trainer = Trainer(build_config(config))
        result = trainer.train()
        frozen = trainer.pipe.transformer
        resident = sum(t.numel() * t.element_size() for t in list(frozen.parameters()) + list(frozen.buffers())
                       if not t.requires_grad)
        runs[quantize] = (trainer, result, resident)

    kept = {"img_in", "time_embed", "time_mod_proj", "txt_in", "final_layer", "text_fusion.projector"}
    from krea2_diffusers import Krea2Transformer2DModel

    with torch.device("meta"):
        reference = Krea2Transformer2DModel(**proportioned_transformer_config())
    kept_fp32 = sum(p.numel() * 4 for n, p in reference.named_parameters() if n.split(".")[0] in kept
                    or n.startswith("text_fusion.projector"))
    fp8_resident = runs["fp8"][2]
    # One byte per quantized weight (+ a float32 scale per row), the kept layers in bf16.
    assert fp8_resident < 0.25 * fp32_bytes + kept_fp32 / 2 + 0.01 * fp32_bytes, (fp8_resident, fp32_bytes)
    assert fp8_resident > 0.24 * (fp32_bytes - kept_fp32)
    assert runs["none"][2] > 0.49 * fp32_bytes  # the bf16 base: half of fp32

    # Both learn: the loss of a plain bf16 pipeline on fixed noise falls once their LoRA is loaded.
    from krea2_diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_single_file(str(model), text_encoder="tiny-random", vae="tiny-random", torch_dtype=torch.bfloat16)
    trainer = runs["none"][0]
    before = _fixed_batch_loss(pipe, trainer, None)
    after = {q: _fixed_batch_loss(pipe, trainer, runs[q][1].output_dir / "lora_diffusers.safetensors") for q in runs}
    assert after["none"] < 0.8 * before, (before, after)
    assert after["fp8"] < 0.8 * before, (before, after)
    assert abs(after["fp8"] - after["none"]) < 0.15 * (before - after["none"]), (before, after)


def test_dry_run_prints_a_plan_and_trains_nothing(tmp_path, medium_file):
    model, _ = medium_file
    out = tmp_path / "run"
    config = _config(out, tmp_path / "cache", model, method="lora", activation_checkpointing="full")
    config["model"].update(quantize="fp8", dtype="bfloat16")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "finetune", str(path), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "memory plan per process" in done.stdout and "frozen base (fp8" in done.stdout
    assert "activations (32x32 px, batch 1, checkpointing full)" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["dry-run.log"]
    assert not (tmp_path / "cache").exists()
