"""The compute-dtype policy (``krea2_diffusers.precision``) and bf16 training on the CPU.

``auto`` (``--dtype auto``, the app's default, the ComfyUI loader's ``auto``, the memory presets'
quantized compute, ``mixed_precision: auto``) is bf16 on CUDA GPUs and CPUs with bf16 units, float32
on other CPUs, float16 (inference) or float32 (training) on older GPUs; ``KREA2_CPU_BF16=0|1`` forces the CPU's answer, so every test here states the
machine it pretends to be and passes on CPUs with and without bf16 units.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors import safe_open

import finetune.data.encoding
from finetune.config import ConfigError, build_config
from krea2_diffusers.cli.generate import resolve_dtype
from krea2_diffusers.precision import (CPU_BF16_ENV, choose_compute_dtype, compute_dtype, cpu_bf16_flags, cpu_has_bf16,
                                       training_precision)

sys.path.insert(0, str(Path(__file__).parent))
from test_finetune_train import lora_config, pooled_latents  # noqa: E402  (the LoRA run's config and stand-in VAE)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one mixed-precision setting per process: reset it around runs that change it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(params=["0", "1"], ids=["cpu-without-bf16", "cpu-with-bf16"])
def cpu_bf16(request, monkeypatch):
    """This machine pretends to have (``1``) or lack (``0``) bf16 units; the expected CPU dtype."""
    monkeypatch.setenv(CPU_BF16_ENV, request.param)
    return torch.bfloat16 if request.param == "1" else torch.float32


# ---------------------------------------------------------------------------------------- policy
def test_cpuinfo_flags_name_the_bf16_units():
    epyc = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nflags\t: fpu\n"
    sapphire = "flags\t: avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert cpu_bf16_flags(epyc) == ["AVX512-BF16"]
    assert cpu_bf16_flags(sapphire) == ["AMX-BF16", "AVX512-BF16"]
    assert cpu_bf16_flags("flags\t: fpu sse avx2 avx512f avx512_vnni\n") == []  # AVX-512 alone emulates bf16
    assert cpu_bf16_flags("Features\t: fp asimd bf16\n") == []  # no x86 flags line


def test_auto_follows_the_cpu_and_cuda_without_a_gpu_here_is_bf16(cpu_bf16):
    assert cpu_has_bf16() == (cpu_bf16 == torch.bfloat16)
    assert compute_dtype("cpu") == cpu_bf16 and compute_dtype(torch.device("cpu")) == cpu_bf16
    assert compute_dtype("cuda") == torch.bfloat16 and compute_dtype("cuda:1") == torch.bfloat16  # no CUDA needed
    chosen = choose_compute_dtype("cpu")
    name = str(cpu_bf16).removeprefix("torch.")
    assert chosen.describe() == f"compute dtype: {name} ({CPU_BF16_ENV}={int(cpu_bf16 == torch.bfloat16)})"


@pytest.mark.parametrize("capability, name, inference, training", [
    ((7, 5), "Tesla T4", torch.float16, torch.float32), ((7, 0), "Tesla V100", torch.float16, torch.float32),
    ((8, 0), "A100", torch.bfloat16, torch.bfloat16), ((9, 0), "H100", torch.bfloat16, torch.bfloat16)])
def test_cuda_auto_is_bf16_only_on_gpus_with_bf16_units(monkeypatch, capability, name, inference, training):
    """Pre-Ampere GPUs (compute capability below 8.0) emulate bf16: ``--dtype auto`` generates in
    float16 there (diffusers' dtype on a T4 or V100) and ``mixed_precision: auto`` trains in float32
    (float16 autocast would need loss scaling); a dtype named is obeyed."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    chosen = resolve_dtype("auto", "cuda")
    assert chosen.dtype == inference and f"{name}, compute capability {capability[0]}.{capability[1]}" in chosen.reason
    assert resolve_dtype("auto", "cuda:1").dtype == inference
    trained = training_precision("auto", "cuda")
    assert trained.dtype == training and trained.mixed_precision == ("bf16" if training == torch.bfloat16 else "no")
    assert training_precision("bf16", "cuda").mixed_precision == "bf16"
    assert resolve_dtype("bfloat16", "cuda").dtype == torch.bfloat16


def test_generate_dtype_auto_follows_the_policy_and_a_name_is_obeyed(cpu_bf16):
    assert resolve_dtype("auto", "cpu").dtype == cpu_bf16
    assert resolve_dtype("auto", "cuda").dtype == torch.bfloat16
    for name in ("float32", "bfloat16", "float16"):
        chosen = resolve_dtype(name, "cpu")
        assert chosen.dtype == getattr(torch, name) and chosen.reason == f"--dtype {name}"


def test_the_detection_answers_without_an_override(monkeypatch):
    """What the real /proc/cpuinfo says is this machine's business; it must say something consistent."""
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    chosen = choose_compute_dtype("cpu")
    assert chosen.dtype == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    assert chosen.describe().startswith("compute dtype: ")


def test_a_bad_override_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=f"{CPU_BF16_ENV} must be 0 .* or 1 .*got 'yes'"):
        compute_dtype("cpu")


def test_quantized_memory_preset_computes_in_the_policy_dtype_on_the_cpu(cpu_bf16):
    """fp8 storage on a CPU computed in bf16 whatever the CPU: 3.6x slower than float32 where bf16 is emulated."""
    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.pipelines.memory import MemoryPlan, apply_plan
    from krea2_diffusers.quantization.fp8 import Fp8Linear

    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    apply_plan(pipe, MemoryPlan(offload="none", transformer_storage="fp8"), torch.device("cpu"))
    layer = pipe.transformer.transformer_blocks[0].ff.up
    assert isinstance(layer, Fp8Linear) and layer.compute_dtype == cpu_bf16


def test_comfyui_loader_offers_auto_by_default(cpu_bf16):
    from comfy_nodes.models import DTYPES, LoadSpec, weight_dtype
    from comfy_nodes.nodes import Krea2ModelLoader

    assert "auto" in DTYPES and LoadSpec("tiny-random").dtype == "auto"
    assert Krea2ModelLoader.INPUT_TYPES()["required"]["dtype"][1]["default"] == "auto"
    assert weight_dtype("auto") == cpu_bf16  # ComfyUI's device here: the CPU
    assert weight_dtype("float16") == torch.float16  # a name is obeyed (the example workflows pin bfloat16)


# ---------------------------------------------------------------------------------------- configs
def test_mixed_precision_auto_resolves_per_device_and_explicit_values_are_obeyed(cpu_bf16):
    assert training_precision("auto", "cpu").mixed_precision == ("bf16" if cpu_bf16 == torch.bfloat16 else "no")
    assert training_precision("auto", "cuda").mixed_precision == "bf16"
    for value, dtype in (("no", torch.float32), ("bf16", torch.bfloat16)):
        for device in ("cpu", "cuda"):
            chosen = training_precision(value, device, "training.mixed_precision")
            assert chosen.dtype == dtype and chosen.reason == f"training.mixed_precision: {value}"


def test_configs_default_to_auto_and_refuse_other_values_by_name(tmp_path):
    from finetune.posttrain.config import PosttrainConfig
    from finetune.pretrain.config import build_pretrain_config

    train = {"output_dir": str(tmp_path), "data": {"path": str(tmp_path)}}
    assert build_config(train).training.mixed_precision == "auto"
    assert build_config(train, ["training.mixed_precision=no"]).training.mixed_precision == "no"
    with pytest.raises(ConfigError, match=r"training\.mixed_precision: 'fp16' is not one of \['auto', 'no', 'bf16'\]"):
        build_config(train, ["training.mixed_precision=fp16"])
    # YAML 1.1 reads an unquoted `no` as false: the file's `mixed_precision: no` still means "no".
    in_file = yaml.safe_load("training: {mixed_precision: no}")
    assert in_file == {"training": {"mixed_precision": False}}
    assert build_config({**train, **in_file}).training.mixed_precision == "no"
    with pytest.raises(ConfigError, match=r"training\.mixed_precision: True is not one of"):
        build_config(train, ["training.mixed_precision=yes"])  # no choice is spelled yes / on / true
    post = {"output_dir": str(tmp_path), "method": "dpo", "dpo": {"data": str(tmp_path / "pairs.jsonl")}}
    assert build_config(post, cls=PosttrainConfig).training.mixed_precision == "auto"
    with pytest.raises(ConfigError, match=r"training\.mixed_precision: 'bfloat16' is not one of .*did you mean 'bf16'"):
        build_config(post, ["training.mixed_precision=bfloat16"], cls=PosttrainConfig)
    pre = {"stages": [{"name": "s", "data": "packs/64"}]}
    assert build_pretrain_config(pre, base_dir=tmp_path).training.mixed_precision == "auto"
    with pytest.raises(ConfigError, match=r"training\.mixed_precision: 'fp32' is not one of"):
        build_pretrain_config(pre, ["training.mixed_precision=fp32"], base_dir=tmp_path)


def test_runtimes_resolve_auto_on_this_cpu(cpu_bf16, fresh_accelerate_state, capsys):
    from finetune.engine.runtime import setup_runtime
    from finetune.pretrain.runtime import make_runtime

    expected = "bf16" if cpu_bf16 == torch.bfloat16 else "no"
    runtime = setup_runtime(build_config({"data": {"path": "x"}}))
    assert runtime.mixed_precision == expected and runtime.accelerator.mixed_precision == expected
    assert "compute dtype: " in capsys.readouterr().out  # the entry point says what it chose and why
    fresh_accelerate_state._reset_state(reset_partial_state=True)
    pretrain = make_runtime("auto")
    assert pretrain.mixed_precision == expected and pretrain.encoder_dtype == cpu_bf16
    fresh_accelerate_state._reset_state(reset_partial_state=True)
    assert make_runtime("no").mixed_precision == "no"  # explicit: obeyed whatever the CPU


# ---------------------------------------------------------------------------------------- bf16 LoRA training
STEPS = 4


def _lora_run(root: Path, cache: Path, mixed_precision: str, resume: bool = False, steps: int = STEPS):
    from accelerate.state import AcceleratorState

    from finetune.trainer import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    raw = lora_config(root, cache, **{"training.max_steps": steps, "training.mixed_precision": mixed_precision,
                                      "data.num_workers": 0, "checkpointing.every_n_steps": 2,
                                      "checkpointing.keep_last": 2, "lora.rank": 4, "lora.alpha": 4,
                                      # validation under the run's precision too: samples at step 2 and the end
                                      "validation.every_n_steps": 2, "validation.num_inference_steps": 2,
                                      "validation.turbo_num_inference_steps": 2, "validation.height": 32,
                                      "validation.width": 32})
    trainer = Trainer(build_config(raw), resume=resume)
    return trainer, trainer.train()


def _exported(out: Path) -> dict[str, dict[str, torch.dtype]]:
    files = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            files[path.name] = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    return files


def test_bf16_lora_training_on_the_cpu(tmp_path, monkeypatch, fresh_accelerate_state):
    """``mixed_precision: auto`` on a CPU with bf16 units: bf16 autocast over float32 LoRA masters
    and optimizer state; losses within bf16 rounding of a float32 run; validation samples made under
    it; a resume continues exactly; the export is the float32 run's, key for key and dtype for dtype."""
    monkeypatch.setattr(finetune.data.encoding, "encode_images", pooled_latents)
    cache = tmp_path / "cache"
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    _, fp32 = _lora_run(tmp_path / "fp32", cache, "no")
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    trainer, bf16 = _lora_run(tmp_path / "bf16", cache, "auto")
    assert trainer.runtime.mixed_precision == "bf16" and trainer.runtime.accelerator.mixed_precision == "bf16"

    # Masters: the trained LoRA weights and the optimizer's moments stay float32.
    assert trainer.params and all(p.dtype == torch.float32 for p in trainer.params)
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    assert moments and all(m.dtype == torch.float32 for m in moments)

    # bf16 rounds each matmul operand to 8 significant bits (unit roundoff u = 2^-9). The tiny
    # model's forward chains about M = 32 roundings (4 text-fusion + 2 main blocks, ~5 matmuls
    # each, plus the in/out projections); independent roundings add in quadrature, so the
    # prediction's relative error is ~ u * sqrt(M), and the squared-error loss doubles a relative
    # error: 2 * 2^-9 * sqrt(32) = 0.022. A factor 2 covers the network's gain and the four steps'
    # drift between the two trajectories: relative 0.044. A float32 run would give 0 difference,
    # and the check that they differ shows the autocast really ran.
    bound = 2 * 2**-9 * math.sqrt(32) * 2
    steps = sorted(fp32.losses)
    assert steps == sorted(bf16.losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(bf16.losses[s]) for s in steps)
    assert any(bf16.losses[s] != fp32.losses[s] for s in steps)
    for s in steps:
        assert abs(bf16.losses[s] - fp32.losses[s]) <= bound * fp32.losses[s], (s, bf16.losses[s], fp32.losses[s])

    # Validation ran under bf16 at step 2 and at the end: real images, not blank.
    for step in (2, STEPS):
        images = sorted((tmp_path / "bf16" / "samples" / f"step-{step:06d}").glob("*.png"))
        assert images, step
        assert np.asarray(Image.open(images[0])).astype(float).std() > 0

    # The export: same files, keys and dtypes as the float32 run's; the diffusers file loads.
    exported = _exported(tmp_path / "bf16")
    assert exported and exported == _exported(tmp_path / "fp32")
    from krea2_diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    diffusers_file = next(p for p in (tmp_path / "bf16").glob("*.safetensors") if "comfy" not in p.name and "kohya" not in p.name)
    pipe.load_lora_weights(str(diffusers_file))

    # Resume from step 2 in bf16: steps 3 and 4 give the uninterrupted bf16 run's losses exactly.
    import shutil

    shutil.rmtree(tmp_path / "bf16" / "checkpoints" / "step-4")
    resumed_trainer, resumed = _lora_run(tmp_path / "bf16", cache, "auto", resume=True)
    assert resumed_trainer.start_step == 2 and sorted(resumed.losses) == [3, 4]
    assert [resumed.losses[s] for s in (3, 4)] == [bf16.losses[s] for s in (3, 4)]


# ---------------------------------------------------------------------------------------- bf16 pretraining
def test_pretrain_auto_trains_in_bf16_on_a_bf16_cpu_with_float32_masters(tmp_path, monkeypatch, fresh_accelerate_state):
    """`krea2 pretrain` fixed float32 on every CPU; ``training.mixed_precision: auto`` now trains
    under bf16 autocast where the CPU has bf16 units, checkpointing float32 weights and moments."""
    from torch.distributed.checkpoint import FileSystemReader

    from finetune.packs.synthetic import make_synthetic_set
    from finetune.pretrain.trainer import Pretrainer
    from krea2_diffusers.cli import main as krea2

    monkeypatch.setenv(CPU_BF16_ENV, "1")
    manifest = make_synthetic_set(tmp_path / "data", count=4)
    assert krea2(["pack", str(manifest), str(tmp_path / "packs/64"), "--resolution", "64", "--batch-size", "2"]) == 0
    (tmp_path / "config.yaml").write_text(
        "output_dir: out\n"
        "model: {architecture: tiny, init: scratch, text_encoder: tiny-random, vae: tiny-random}\n"
        "optimizer: {name: adamw, learning_rate: 2.0e-3}\n"
        "checkpointing: {every_n_steps: 2, keep_last: 1}\n"
        "logging: {progress_bar: false, tensorboard: false}\n"
        "stages: [{name: s64, data: packs/64, resolution: 64, batch_size: 2, steps: 2}]\n")
    runtimes = []
    init = Pretrainer.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        runtimes.append(self.runtime)

    monkeypatch.setattr(Pretrainer, "__init__", recording)
    assert krea2(["pretrain", str(tmp_path / "config.yaml")]) == 0
    assert [r.mixed_precision for r in runtimes] == ["bf16"] and runtimes[0].accelerator.mixed_precision == "bf16"
    rows = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    metadata = FileSystemReader(str(tmp_path / "out/checkpoints/step-2")).read_metadata().state_dict_metadata
    floats = {k: m.properties.dtype for k, m in metadata.items() if hasattr(m, "properties") and m.properties.dtype.is_floating_point}
    assert any(k.startswith("model.") for k in floats) and any(k.startswith("optim") for k in floats)
    assert set(floats.values()) == {torch.float32}, {k: v for k, v in floats.items() if v != torch.float32}
