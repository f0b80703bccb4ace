"""Every advertised LoRA base (``model.quantize: none | fp8 | int8 | nf4``) end to end, on a tiny
random model in the original single-file layout, shaped so that ComfyUI's native loader can build
its blocks (one 128-wide head, as ComfyUI's Krea 2 requires; 2 blocks; 0.7 M parameters).

Per base: a run trains with validation on (samples at step 4, after the step-4 checkpoint) and dies
after step 7 without saving anything more: one base (``KILLED``) is a real ``python -m finetune``
process killed with SIGKILL, the others die in-process (an exception right after step 7 is logged;
one kill -9 covers the mechanism, the resume is what each base needs). ``--resume`` redoes steps
5-7 with the same losses, validates again and exports the three LoRA files. The checkpoint holds the
adapters and their optimizer state only (never a quantized layer's packed weight or quantization
state), and so do the exports; they load in a plain bf16 pipeline, lower its loss on fixed noise
like the bf16 base's LoRA does (measured outside the trainer), and load in a real ComfyUI's native
``LoraLoaderModelOnly`` with no key left over, its patched weights equal to base + up @ down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import finetune.trainer
from finetune.config import ConfigError, build_config
from finetune.engine.checkpoint import latest_checkpoint
from finetune.metrics import read_metrics
from finetune.trainer import Trainer
from krea2_diffusers.models.tiny import save_random_original_file
from lora_checks import (COMFY_TEXT_WIDTH, DiedAfterStep, comfy_model_config, comfy_patched, dying_metrics_logger,
                         fixed_batch_loss, save_comfy_text_encoder)

ROOT = Path(__file__).resolve().parents[1]
BASES = ("none", "fp8", "int8", "nf4")
MAX_STEPS, EVERY, KILL_AT = 12, 4, 7
KILLED = "nf4"  # the base whose run is a real process killed with SIGKILL (the most state to rebuild)
# What a quantized layer keeps besides its adapters: never in a checkpoint or an export.
QUANT_STATE = re.compile(r"weight_scale|absmax|quant_map|quant_state|nested_|SCB|weight_format|\.base_layer\.")
QUANTIZED_LAYER = {"fp8": "Fp8Linear", "int8": "Int8Linear", "nf4": "Nf4Linear"}
# Resident bytes of the frozen blocks / their float32 bytes (99.4% of them are linear weights).
RESIDENT_SHARE = {"none": (0.49, 0.51), "fp8": (0.245, 0.27), "int8": (0.245, 0.27), "nf4": (0.12, 0.135)}
pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(root: Path, model: Path, quantize: str) -> dict:
    """Adapters on the blocks and the text-fusion blocks, over a text encoder as wide as ComfyUI's text
    fusion (``root/text_encoder``, written by the ``runs`` fixture)."""
    return {
        "output_dir": str(root / quantize),
        "model": {"pretrained_model_name_or_path": str(model), "text_encoder": str(root / "text_encoder"), "vae": "tiny-random",
                  "dtype": "bfloat16", "quantize": quantize},
        "data": {"synthetic": {"num_prompts": 2, "size": 32}, "resolution": 32, "caption_dropout": 0.0,
                 "cache_dir": str(root / "cache"), "num_workers": 0},
        "training": {"method": "lora", "max_steps": MAX_STEPS, "batch_size": 2, "seed": 3},
        "lora": {"rank": 8, "alpha": 8, "train_text_fusion": True},
        "optimizer": {"learning_rate": 4e-3},
        "checkpointing": {"every_n_steps": EVERY, "keep_last": 1},
        "validation": {"prompts": ["red"], "num_inference_steps": 2, "guidance_scale": 3.5, "height": 32, "width": 32,
                       "every_n_steps": EVERY},
        "logging": {"progress_bar": False, "tensorboard": False},
    }




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(quantize)`` -> (trainer, died run's metrics rows, last checkpoint step when it died,
    resumed result). ``KILLED``'s run is a worker process (tests/sigkill_runs.py) killed with SIGKILL
    while the other bases' runs die in-process here, at the same time (its own feature cache: the
    two sides never write one together); each resumes here on first use."""
    root = tmp_path_factory.mktemp("bases")
    model = root / "krea2_tiny_comfy.safetensors"
    save_random_original_file(model, comfy_model_config(COMFY_TEXT_WIDTH), seed=0)
    save_comfy_text_encoder(root / "text_encoder", seed=0)
    killed_config = run_config(root, model, KILLED)
    killed_config["data"]["cache_dir"] = str(root / "cache-killed")
    path = root / f"{KILLED}.yaml"
    path.write_text(yaml.safe_dump(killed_config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out, log = root / "worker.out", root / "worker.log"  # files, not pipes: nobody reads while the runs here train
    with open(out, "w") as stdout, open(log, "w") as stderr:
        worker = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sigkill_runs.py"), str(KILL_AT), str(path)],
                                  cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    died = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the function-scoped one_thread fixture
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(finetune.trainer, "MetricsLogger", dying_metrics_logger(KILL_AT))
            for quantize in BASES:
                if quantize != KILLED:
                    with pytest.raises(DiedAfterStep):
                        Trainer(build_config(run_config(root, model, quantize))).train()
    finally:
        torch.set_num_threads(threads)
        worker.wait(timeout=900)
    stdout, stderr = out.read_text(), log.read_text()
    assert worker.returncode == 0, stdout[-2000:] + stderr[-4000:]
    report = json.loads(stdout.splitlines()[-1])
    assert report["signal"] == 9, f"{KILLED}: the run was not killed mid-run: {report}\n{stderr[-3000:]}"
    for quantize in BASES:
        rows = read_metrics(root / quantize)
        last = latest_checkpoint(root / quantize / "checkpoints")
        died[quantize] = (rows, int(last.name.split("-")[1]) if last else 0)
    cache = {}

    def get(quantize: str):
        if quantize not in cache:
            config = killed_config if quantize == KILLED else run_config(root, model, quantize)
            trainer = Trainer(build_config(config), resume=True)
            cache[quantize] = (trainer, *died[quantize], trainer.train())
        return cache[quantize]

    get.model = model
    get.root = root
    return get


@pytest.mark.parametrize("quantize", BASES)
def test_lora_base_trains_checkpoints_dies_resumes_validates_and_exports(runs, quantize):
    trainer, killed_rows, checkpoint_step, result = runs(quantize)
    out = result.output_dir
    blocks = trainer.pipe.transformer.transformer_blocks
    if quantize != "none":
        assert QUANTIZED_LAYER[quantize] in {type(m).__name__ for m in blocks.modules()}
    # The frozen blocks' resident bytes against their float32 size in the file: bf16 half, fp8 and int8
    # a byte per weight (+ a float32 scale per row, bf16 norms), nf4 half a byte (bitsandbytes keeps
    # absmax / SCB outside the parameters: packed weights are what is counted there).
    resident = sum(t.numel() * t.element_size() for t in [*blocks.parameters(), *blocks.buffers()] if not t.requires_grad)
    with safe_open(str(runs.model), "pt") as f:
        fp32 = sum(4 * int(np.prod(f.get_slice(k).get_shape()))
                   for k in f.keys() if k.startswith("blocks."))
    low, high = RESIDENT_SHARE[quantize]
    assert low < resident / fp32 < high, (quantize, resident / fp32)
    # Died after step 7 (kill -9 or in-process): the step-4 checkpoint is resumed and steps 5-7 come out the same.
    assert checkpoint_step == EVERY and len(killed_rows) >= KILL_AT > checkpoint_step
    assert not result.interrupted and result.final_step == MAX_STEPS
    resumed = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert sorted(resumed) == list(range(1, MAX_STEPS + 1))
    redone = [r for r in killed_rows if r["step"] > checkpoint_step]
    assert len(redone) >= KILL_AT - EVERY
    torch.testing.assert_close(torch.tensor([resumed[r["step"]] for r in redone]), torch.tensor([r["loss"] for r in redone]),
                               rtol=1e-5, atol=1e-6)

    # Validation with the quantized base: samples from the run that died (step 4) and the resumed one.
    for step in (EVERY, MAX_STEPS):
        image = np.asarray(Image.open(out / "samples" / f"step-{step:06d}" / "raw-00.png")).astype(float)
        assert image.shape == (32, 32, 3) and image.std() > 0

    # The checkpoint: the adapters and their optimizer state, nothing of the frozen base.
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = latest_checkpoint(out / "checkpoints")
    keys = [k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
            if k.startswith(("model.", "optimizer.state."))]
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k and not QUANT_STATE.search(k) for k in keys), keys
    targets = [n for n, p in trainer.pipe.transformer.named_parameters() if p.requires_grad]
    assert sorted(k.removeprefix("model.") for k in model_keys) == sorted(targets)

    # The exports: three files, adapters only, one pair per adapted layer.
    assert sorted(p.name for p in result.exported) == ["lora_comfyui.safetensors", "lora_diffusers.safetensors",
                                                        "lora_kohya.safetensors"]
    for path in result.exported:
        tensors = load_file(str(path))
        assert not [k for k in tensors if QUANT_STATE.search(k)]
        assert len([k for k in tensors if not k.endswith(".alpha")]) == len(targets)


@pytest.fixture(scope="module")
def bf16_pipe(runs):
    from krea2_diffusers import Krea2Pipeline

    return Krea2Pipeline.from_single_file(str(runs.model), text_encoder=str(runs.root / "text_encoder"), vae="tiny-random",
                                          torch_dtype=torch.bfloat16)


@pytest.mark.parametrize("quantize", BASES)
def test_lora_of_each_base_loads_and_learns_in_a_plain_bf16_pipeline(runs, bf16_pipe, quantize):
    trainer, *_, result = runs(quantize)
    reference = runs("none")[-1].output_dir / "lora_diffusers.safetensors"
    before = fixed_batch_loss(bf16_pipe, trainer, None)
    after = {path.name: fixed_batch_loss(bf16_pipe, trainer, path) for path in result.exported}
    bf16 = fixed_batch_loss(bf16_pipe, trainer, reference)
    print(f"{quantize}: loss without LoRA {before:.4f}, with {after}, with the bf16 base's {bf16:.4f}")
    assert max(after.values()) - min(after.values()) < 1e-2 * before  # the three files are the same LoRA
    for loss in after.values():
        assert loss < 0.9 * before, (before, after)
        assert abs(loss - bf16) < 0.15 * (before - bf16), (before, after, bf16)


@pytest.mark.parametrize("quantize", BASES)
def test_lora_of_each_base_loads_in_real_comfyuis_native_lora_loader(runs, comfyui, quantize):
    """ComfyUI builds its model from a file with our shapes (its text fusion 40 wide, a multiple of its
    20 text heads, as the run's), patches it with each exported file (the blocks' and the text-fusion
    blocks' adapters) in ``LoraLoaderModelOnly`` and writes the patched weights with ``ModelSave``."""
    from krea2_diffusers.loaders.convert import diffusers_module_to_original

    *_, result = runs(quantize)
    base, patched_files = comfy_patched(comfyui, result.exported, quantize)
    lora = load_file(str(result.output_dir / "lora_diffusers.safetensors"))
    modules = sorted(k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in lora if k.endswith(".lora_A.weight"))
    assert len([m for m in modules if m.startswith("text_fusion.")]) == 32  # 8 projections x 4 text-fusion blocks
    for path, patched in patched_files.items():
        changed = {k for k in base if not torch.equal(patched[k], base[k])}
        expected = {diffusers_module_to_original(m) + ".weight" for m in modules}
        assert changed == expected, (path.name, sorted(changed ^ expected)[:5])
        for module in modules:
            key = diffusers_module_to_original(module) + ".weight"
            up = lora[f"transformer.{module}.lora_B.weight"].double()
            down = lora[f"transformer.{module}.lora_A.weight"].double()
            # float32 weights: ComfyUI adds the float32 product to the float32 weight (one rounding each)
            torch.testing.assert_close(patched[key].double(), base[key].double() + up @ down, rtol=1e-6, atol=1e-6)


def test_bitsandbytes_missing_is_an_error_before_any_model_loads(tmp_path, monkeypatch):
    import finetune.model
    from finetune.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before bitsandbytes was checked")

    monkeypatch.setattr(finetune.model, "load_pipeline", no_model)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    config = run_config(tmp_path, Path("unused.safetensors"), "nf4")
    with pytest.raises(ConfigError, match=r"model.quantize='nf4': bitsandbytes needs to be installed .*import of bitsandbytes halted"):
        Trainer(build_config(config))
    path = tmp_path / "int8.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path, Path("unused.safetensors"), "int8")))
    assert main([str(path)]) == 2
    assert not (tmp_path / "int8").exists()
