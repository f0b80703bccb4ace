"""Training a model too large to copy per process: a medium (~170 MB fp32) original-layout file
made on the fly, with the tiny text encoder and VAE.

* full fine-tune with 2 real processes (torchrun, gloo): each rank's memory while the transformer
  is set up stays near half the fp32 size (measured: RSS sampled in the rank), the losses equal a
  1-process run's, the checkpoint is a DCP folder with one shard file per rank, and resuming it
  with 1 process continues with the same losses;
* ``--dry-run`` prints a plan and trains nothing.

(LoRA on quantized bases: ``test_finetune_lora_bases``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cli import main as finetune_main
from finetune.export.writer import model_tensors
from finetune.metrics import read_metrics
from krea2_diffusers.models.tiny import proportioned_transformer_config, save_random_original_file
from launcher import launch

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

    # Resume the 2-process checkpoint with 1 process (the CLI, in this process: no memory probed):
    # the same global batch, the same losses.
    path = two / "resume.yaml"
    path.write_text(yaml.safe_dump(_config(two / "run", cache, model, max_steps=4)))
    assert finetune_main([str(path), "--resume"]) == 0
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


def test_dry_run_prints_a_plan_and_trains_nothing(tmp_path, medium_file, no_model_loading, capsys):
    model, _ = medium_file
    out = tmp_path / "run"
    config = _config(out, tmp_path / "cache", model, method="lora", activation_checkpointing="full")
    config["model"].update(quantize="fp8", dtype="bfloat16")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert finetune_main([str(path), "--dry-run"]) == 0  # the CLI in this process: a model load fails the test
    printed = capsys.readouterr().out
    assert "memory plan per process" in printed and "frozen base (fp8" in printed
    assert "activations (32x32 px, batch 1, checkpointing full)" in printed
    assert sorted(p.name for p in out.iterdir()) == ["dry-run.log"]
    assert not (tmp_path / "cache").exists()
