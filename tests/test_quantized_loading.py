"""Streamed quantized loading (krea2_diffusers.loaders.quantized): block by block, equal to loading
in full precision and quantizing afterwards; the CLI's plan before loading and its bad-input errors.
The load's peak memory is checked on a medium model in test_load_memory.py."""

from pathlib import Path

import pytest
import torch

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
from krea2_diffusers.cli import main
from krea2_diffusers.files import save_safetensors
from krea2_diffusers.loaders.assembly import load_pipeline
from krea2_diffusers.loaders.quantized import planned_transformer_bytes, quantize_storage_
from krea2_diffusers.models.tiny import proportioned_transformer_config, save_random_original_file
from krea2_diffusers.quantization.gguf import resident_bytes

CONFIG = proportioned_transformer_config(num_layers=2, heads=2, head_dim=64)
LAYERS = {"fp8": "Fp8Linear", "int8": "Int8Linear", "nf4": "Nf4Linear"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "krea2-small.safetensors"
    save_random_original_file(path, CONFIG, seed=0, dtype=torch.bfloat16)
    return path


def _inputs():
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=torch.randn(1, 8, 12, 32, generator=g),
                timestep=torch.tensor([0.5]), position_ids=torch.zeros(24, 3), return_dict=False)


@pytest.mark.parametrize("mode", ["fp8", "int8", "nf4"])
def test_streamed_load_equals_quantizing_the_loaded_model(checkpoint, mode):
    streamed = Krea2Transformer2DModel.from_single_file(checkpoint, torch_dtype=torch.float32, quantization=mode)
    whole = Krea2Transformer2DModel.from_single_file(checkpoint, torch_dtype=torch.float32)
    reference = Krea2Transformer2DModel.from_single_file(checkpoint, torch_dtype=torch.float32)
    quantize_storage_(whole, mode, torch.float32)
    assert {type(m).__name__ for m in streamed.transformer_blocks.modules() if "Linear" in type(m).__name__} == {LAYERS[mode]}
    a, b = streamed.state_dict(), whole.state_dict()
    assert set(a) == set(b)
    with torch.no_grad():
        got, same, want = streamed(**_inputs())[0], whole(**_inputs())[0], reference(**_inputs())[0]
    if mode != "fp8":
        # bitsandbytes quantizes from the file's bf16 while streaming, from float32 after a whole
        # load (its CPU kernels take the input dtype's path): the two agree to the format's error only.
        assert ((got - same).norm() / same.norm()).item() < 2e-2
    else:
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert torch.equal(got, same)
    assert ((got - want).norm() / want.norm()).item() < 5e-2  # the quantization error, not a broken layer
    resident, loading = planned_transformer_bytes(Krea2Transformer2DModel, CONFIG, mode, torch.float32)
    assert resident == resident_bytes(streamed)  # the plan counts what the loader keeps, exactly
    assert loading > 0


def test_pipeline_loader_streams_the_transformer(checkpoint):
    pipe = load_pipeline(Krea2Pipeline, str(checkpoint), text_encoder="tiny-random", vae="tiny-random",
                         torch_dtype=torch.float32, quantization="fp8")
    assert any(type(m).__name__ == "Fp8Linear" for m in pipe.transformer.modules())
    image = pipe("a red square", height=64, width=64, num_inference_steps=2, guidance_scale=0.0,
                 generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert torch.isfinite(image).all()


def test_generate_dry_run_says_what_does_not_fit_and_what_would(checkpoint, monkeypatch, capsys):
    from krea2_diffusers.pipelines import host_memory

    nf4 = host_memory.plan_host_memory(checkpoint, "nf4", torch.float32).total
    fp8 = host_memory.plan_host_memory(checkpoint, "fp8", torch.float32).total
    assert nf4 < fp8
    monkeypatch.setattr(host_memory, "host_ram", lambda: (nf4 + fp8) // 2)
    out_png = checkpoint.parent / "never.png"
    args = ["generate", "x", "--model", str(checkpoint), "--text-encoder", "tiny-random", "--vae", "tiny-random",
            "--quantize", "fp8", "--width", "64", "--height", "64", "--output", str(out_png), "--dry-run"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "GiB short; nf4 would fit" in text, text
    assert not out_png.exists()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_inputs_fail_with_one_line_naming_the_file(checkpoint, tmp_path, capsys):
    flux = tmp_path / "flux.safetensors"
    save_safetensors({"double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2)}, flux)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    out = tmp_path / "out"
    cases = [
        (["generate", "x", "--model", str(flux), "--quantize", "nf4", "--output", f"{out}.png"], "flux.safetensors: this is a Flux checkpoint"),
        (["generate", "x", "--model", str(cut), "--quantize", "fp8", "--output", f"{out}.png"], "cut.safetensors: file is truncated"),
        (["generate", "x", "--model", str(gguf), "--quantize", "fp8", "--output", f"{out}.png"], "model.gguf: a GGUF file is already quantized"),
        (["quantize", str(gguf), f"{out}.gguf", "--type", "Q4_K"], "model.gguf: input must be a .safetensors file"),
        (["quantize", str(cut), f"{out}.gguf", "--type", "Q4_K"], "cut.safetensors: file is truncated"),
        (["quantize", str(flux), f"{out}.gguf", "--type", "Q4_K"], "flux.safetensors: this is a Flux checkpoint"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        line = _one_error_line(capsys)
        assert message in line, (argv, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.safetensors", "flux.safetensors", "model.gguf"]



def test_memory_preset_storage_is_chosen_from_the_file_before_loading(checkpoint, monkeypatch):
    from krea2_diffusers.pipelines import memory

    assert memory.storage_for_file(checkpoint, "high", "cpu") is None  # no budget: full precision
    monkeypatch.setattr(memory, "_budget", lambda preset, device: 1)  # nothing fits: the smallest storage is chosen
    monkeypatch.setattr(memory, "_bnb_usable", lambda: True)
    assert memory.storage_for_file(checkpoint, "8gb", "cpu", text_encoder="tiny-random", vae="tiny-random") == "fp8"
    monkeypatch.setattr(memory, "ACTIVATION_HEADROOM", 0)
    small = memory.plan_memory(1000, 0, 0, 400, bnb_available=True)
    assert small.transformer_storage == "nf4"  # the same planner, given sizes that NF4 fits
    assert memory.storage_for_file(checkpoint.with_suffix(".gguf"), "8gb", "cpu") is None


def test_gguf_plan_counts_what_the_loader_keeps(checkpoint, tmp_path):
    """The host plan's GGUF row: packed weights as stored plus every other tensor in the compute
    dtype (norm scales float32), equal to the loaded transformer's bytes, for two dtypes."""
    from krea2_diffusers.pipelines import host_memory
    from krea2_diffusers.quantization.gguf.loader import planned_gguf_bytes

    gguf = tmp_path / "small-Q4_K.gguf"
    assert main(["quantize", str(checkpoint), str(gguf), "--type", "Q4_K"]) == 0
    for dtype in (torch.float32, torch.bfloat16):
        loaded = Krea2Transformer2DModel.from_single_file(gguf, torch_dtype=dtype)
        assert planned_gguf_bytes(Krea2Transformer2DModel, gguf, dtype) == resident_bytes(loaded), dtype
    rows = dict(host_memory.plan_host_memory(gguf, None, torch.float32, tokens=64).rows)
    assert rows["largest transient (loading: one block + quantizer temporaries; or compute)"] > 0
