"""The files ComfyUI users hold, read by the library: a single-file Qwen3-VL (Hugging Face layout), the
Qwen-Image VAE in Wan 2.1 layout, ComfyUI's scaled-fp8 checkpoints; wrong files refused by name;
``krea2 quantize --type fp8``; GGUF modulation tables; published files readable by other users."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, safe_open

from krea2_diffusers import CheckpointError, Krea2Pipeline, Krea2Transformer2DModel, convert_diffusers_to_original
from krea2_diffusers.cli import main
from krea2_diffusers.files import save_safetensors
from krea2_diffusers.quantization.fp8 import Fp8Linear, quantize_weight
from krea2_diffusers.loaders import comfy_fp8
from krea2_diffusers.loaders.text_encoder import load_text_encoder_file, text_encoder_state_dict
from krea2_diffusers.loaders.vae import diffusers_to_wan, load_vae_file, save_wan_vae
from krea2_diffusers.models.tiny import tiny_components, tiny_text_encoder_config, tiny_transformer_config

PUBLISHED_MODE = 0o644
# Tiny models: one thread (conftest.one_thread; with 2 threads a busy 2-core machine spends most of the
# time synchronising them).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def parts():
    return tiny_components(seed=7)


@pytest.fixture(autouse=True)
def usual_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def assert_readable_by_others(path):
    assert stat.S_IMODE(os.stat(path).st_mode) == PUBLISHED_MODE, f"{path}: mode {oct(os.stat(path).st_mode)}"


# ----------------------------------------------------------------------------- text encoder
def test_single_file_text_encoder_encodes_exactly_as_the_model_it_was_saved_from(parts, tmp_path):
    path = tmp_path / "qwen3vl_4b_tiny.safetensors"
    save_safetensors(text_encoder_state_dict(parts["text_encoder"]), path)
    assert "lm_head.weight" not in load_file(path)  # tied head left out, as in the released 4B files
    reference = Krea2Pipeline.from_pretrained("tiny-random", seed=7)
    loaded = Krea2Pipeline.from_pretrained("tiny-random", seed=7, text_encoder=load_text_encoder_file(path))
    assert loaded.text_encoder.lm_head.weight is loaded.text_encoder.model.language_model.embed_tokens.weight
    prompts = ["a red fox asleep in snow", "a lighthouse"]
    (a, mask_a), (b, mask_b) = reference.encode_prompt(prompts), loaded.encode_prompt(prompts)
    assert torch.equal(mask_a, mask_b) and torch.equal(a, b)


def test_text_encoder_config_for_other_sizes_and_shape_checks(parts, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny_text_encoder_config()
    config.text_config.num_hidden_layers = 4  # not a built-in size
    model = Qwen3VLForConditionalGeneration(config).eval()
    path = tmp_path / "qwen3vl_small.safetensors"
    save_safetensors(text_encoder_state_dict(model), path)
    with pytest.raises(CheckpointError, match=r"qwen3vl_small.safetensors: .*hidden size 32, 4 text layers.*not Qwen3-VL-4B.*text_encoder_config"):
        load_text_encoder_file(path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config.to_dict()))
    loaded = load_text_encoder_file(path, config=tmp_path / "cfg")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    wrong = tiny_text_encoder_config()  # 36 layers: does not fit the 4-layer file
    with pytest.raises(CheckpointError, match="does not fit text_encoder_config"):
        load_text_encoder_file(path, config=wrong)


def test_the_built_in_4b_config_fits_the_released_shapes():
    """ComfyUI recognises the 4B by ``model.visual.merger.linear_fc2.weight`` of width 2560; the
    released config has 36 layers of width 2560 and a 24-block vision tower."""
    from krea2_diffusers.loaders.text_encoder import _expected_shapes, builtin_configs

    shapes = _expected_shapes(builtin_configs()["Qwen3-VL-4B-Instruct"])
    assert shapes["model.visual.merger.linear_fc2.weight"] == (2560, 4096)
    assert shapes["model.language_model.embed_tokens.weight"] == (151936, 2560)
    assert shapes["model.language_model.layers.35.mlp.down_proj.weight"] == (2560, 9728)
    assert "model.language_model.layers.36.mlp.down_proj.weight" not in shapes
    assert shapes["model.visual.deepstack_merger_list.2.linear_fc2.weight"] == (2560, 4096)
    assert shapes["model.visual.blocks.23.mlp.linear_fc1.weight"] == (4096, 1024)


@pytest.mark.parametrize("keys, what", [
    ({"encoder.block.0.layer.0.SelfAttention.q.weight": (8, 8), "shared.weight": (10, 8)}, "T5"),
    ({"model.layers.0.self_attn.q_proj.bias": (8,), "model.layers.0.self_attn.q_proj.weight": (8, 8),
      "visual.blocks.0.attn.qkv.weight": (24, 8)}, "Qwen2.5-VL"),
    ({"model.language_model.embed_tokens.weight": (10, 8), "model.visual.blocks.0.attn.qkv.weight": (24, 8),
      "model.language_model.layers.0.self_attn.q_proj.bias": (8,)}, "Qwen2.5-VL"),
    ({"first.weight": (8, 64), "blocks.0.attn.wq.weight": (8, 8)}, "Krea 2 transformer"),
])
def test_wrong_text_encoder_files_are_refused_by_name(tmp_path, keys, what):
    path = tmp_path / "not_qwen3vl.safetensors"
    save_safetensors({k: torch.zeros(shape) for k, shape in keys.items()}, path)
    with pytest.raises(CheckpointError, match=f"not_qwen3vl.safetensors: this is .*{what}"):
        load_text_encoder_file(path)


# ----------------------------------------------------------------------------- VAE
def test_wan_layout_vae_decodes_exactly_as_the_diffusers_one(parts, tmp_path):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    vae = parts["vae"]
    wan, diffusers_file = tmp_path / "qwen_image_vae.safetensors", tmp_path / "diffusers_vae.safetensors"
    save_wan_vae(vae, wan)
    save_safetensors(vae.state_dict(), diffusers_file)
    assert "decoder.middle.0.residual.0.gamma" in load_file(wan)
    latents = torch.randn(1, 16, 1, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = vae.decode(latents).sample
        for path in (wan, diffusers_file):
            assert torch.equal(load_vae_file(path).decode(latents).sample, expected), path
    # The key table agrees with diffusers' own Wan 2.1 converter on ComfyUI's VAE shape (2 res blocks).
    from diffusers import AutoencoderKLQwenImage

    full = AutoencoderKLQwenImage(base_dim=8, z_dim=16).state_dict()
    assert convert_wan_vae_to_diffusers({diffusers_to_wan(k, 2): v for k, v in full.items()}).keys() == full.keys()


@pytest.mark.parametrize("keys, what", [
    ({"decoder.mid.block_1.norm1.weight": (8,), "encoder.conv_in.weight": (8, 3, 3, 3)}, "Flux / Stable Diffusion VAE"),
    ({"decoder.middle.0.residual.0.gamma": (8, 1, 1, 1), "decoder.upsamples.0.upsamples.0.residual.2.weight": (8,)}, "Wan 2.2"),
    ({"model.language_model.embed_tokens.weight": (10, 8)}, "not a VAE"),
])
def test_wrong_vae_files_are_refused_by_name(tmp_path, keys, what):
    path = tmp_path / "other_vae.safetensors"
    save_safetensors({k: torch.zeros(shape) for k, shape in keys.items()}, path)
    with pytest.raises(CheckpointError, match=f"other_vae.safetensors: .*{what}"):
        load_vae_file(path)


# ----------------------------------------------------------------------------- ComfyUI's fp8
def test_fp8_linear_is_the_dequantized_linear():
    weight = torch.randn(6, 8).to(torch.float8_e4m3fn)
    x, bias = torch.randn(3, 8, dtype=torch.float64), torch.randn(6)
    for scale in (torch.tensor(0.01), torch.rand(6) + 0.5):
        layer = Fp8Linear(weight, scale, bias)
        dense = (weight.float() * scale.reshape(-1, 1)).double()  # fp8 * scale in float32, as ComfyUI dequantizes
        torch.testing.assert_close(layer(x), x @ dense.T + bias.double(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="scalar or one value per output row"):
        Fp8Linear(weight, torch.ones(3))


@pytest.fixture(scope="module")
def original_file(parts, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "krea2_turbo_bf16.safetensors"
    save_safetensors(convert_diffusers_to_original(parts["transformer"].state_dict()), path)
    return path


def test_krea2_quantize_fp8_writes_comfyuis_format_and_it_loads_back(original_file, tmp_path):
    out = tmp_path / "krea2_turbo_fp8_scaled.safetensors"
    assert main(["quantize", str(original_file), str(out), "--type", "fp8"]) == 0
    assert_readable_by_others(out)
    with safe_open(str(out), "pt") as f:
        layers = json.loads(f.metadata()["_quantization_metadata"])
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert layers["format_version"] == "1.0" and layers["layers"]["blocks.0.attn.wq"] == {"format": "float8_e4m3fn"}
    assert stored["blocks.0.attn.wq.weight"].dtype == torch.float8_e4m3fn and stored["blocks.0.attn.wq.weight_scale"].ndim == 0
    assert stored["first.weight"].dtype == torch.float32 and "first" not in layers["layers"]  # kept, as GGUF keeps it
    # Our reading equals the dequantized weights (fp8 * scale), computed independently here.
    kept = Krea2Transformer2DModel.from_single_file(out, torch_dtype=torch.float32)
    upcast = Krea2Transformer2DModel.from_single_file(out, torch_dtype=torch.float32, upcast_fp8=True)
    layer = kept.transformer_blocks[0].attn.to_q
    assert isinstance(layer, Fp8Linear) and layer.fp8_weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.fp8_weight.view(torch.uint8), stored["blocks.0.attn.wq.weight"].view(torch.uint8))
    dequantized = stored["blocks.0.attn.wq.weight"].float() * stored["blocks.0.attn.wq.weight_scale"]
    assert torch.equal(upcast.transformer_blocks[0].attn.to_q.weight, dequantized)
    assert torch.equal(layer.dequantized_weight(), dequantized)
    original = load_file(original_file)["blocks.0.attn.wq.weight"]
    assert (dequantized - original).abs().max() <= original.abs().max() / 8  # e4m3: 3 mantissa bits
    # The fp8 layers' forward in a whole pipeline equals the upcast model's.
    pipe = Krea2Pipeline.from_single_file(out, text_encoder="tiny-random", vae="tiny-random", torch_dtype=torch.float32)
    # The same text encoder, tokenizer and VAE (loaded once): the pipelines differ in the transformer only.
    pipe_upcast = Krea2Pipeline.from_single_file(out, text_encoder=pipe.text_encoder, vae=pipe.vae, tokenizer=pipe.tokenizer,
                                                 torch_dtype=torch.float32, upcast_fp8=True)
    for p in (pipe, pipe_upcast):
        p.set_progress_bar_config(disable=True)
    run = dict(prompt="a fox", height=32, width=32, num_inference_steps=2, output_type="latent",
               generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pipe(**run).images, pipe_upcast(**{**run, "generator": torch.Generator().manual_seed(0)}).images,
                               rtol=1e-5, atol=1e-5)
    # A LoRA attaches to the fp8 layers as to plain ones: same effect as on the upcast model.
    lora = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 64) * 0.5,
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(64, 4) * 0.5}
    for p in (pipe, pipe_upcast):
        p.load_lora_weights(lora)
    with_lora = pipe(**{**run, "generator": torch.Generator().manual_seed(0)}).images
    torch.testing.assert_close(with_lora, pipe_upcast(**{**run, "generator": torch.Generator().manual_seed(0)}).images,
                               rtol=1e-5, atol=1e-5)


def test_older_scaled_fp8_form_and_missing_scales(original_file, tmp_path):
    """``scale_weight`` + a ``scaled_fp8`` marker (older ComfyUI files) read the same; a weight without its scale is refused."""
    tensors = load_file(original_file)
    weight = tensors["blocks.0.mlp.up.weight"]
    fp8, scale = quantize_weight(weight, per_row=False)
    old = {**tensors, "blocks.0.mlp.up.weight": fp8, "blocks.0.mlp.up.scale_weight": scale,
           "scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    save_safetensors(old, tmp_path / "old.safetensors")
    model = Krea2Transformer2DModel.from_single_file(tmp_path / "old.safetensors", upcast_fp8=True, torch_dtype=torch.float32)
    assert torch.equal(model.transformer_blocks[0].ff.up.weight, fp8.float() * scale)
    nvfp4 = {**load_file(original_file), "blocks.0.mlp.up.comfy_quant": torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)}
    save_safetensors(nvfp4, tmp_path / "nvfp4.safetensors")
    with pytest.raises(CheckpointError, match="nvfp4.safetensors: layer 'blocks.0.mlp.up' is quantized as 'nvfp4'"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "nvfp4.safetensors")
    del old["blocks.0.mlp.up.scale_weight"]
    save_safetensors(old, tmp_path / "no_scale.safetensors")
    with pytest.raises(CheckpointError, match=r"no_scale.safetensors: tensor 'blocks.0.mlp.up.weight' is float8 but its scale .* is missing"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "no_scale.safetensors")


def test_fp8_text_encoder_file(parts, tmp_path):
    src, out = tmp_path / "qwen3vl_4b_tiny.safetensors", tmp_path / "qwen3vl_4b_fp8_scaled.safetensors"
    save_safetensors(text_encoder_state_dict(parts["text_encoder"]), src)
    assert main(["quantize", str(src), str(out), "--type", "fp8"]) == 0
    stored = load_file(out)
    name = "model.language_model.layers.3.mlp.down_proj"
    assert stored[name + ".weight"].dtype == torch.float8_e4m3fn
    assert stored["model.language_model.embed_tokens.weight"].dtype == torch.float32  # embeddings kept
    kept = load_text_encoder_file(out)
    layer = kept.model.language_model.layers[3].mlp.down_proj
    assert isinstance(layer, Fp8Linear)
    assert torch.equal(layer.dequantized_weight(), stored[name + ".weight"].float() * stored[name + ".weight_scale"])
    ids = torch.tensor([[5, 6, 7]])
    upcast = load_text_encoder_file(out, upcast_fp8=True)
    torch.testing.assert_close(kept(input_ids=ids).logits, upcast(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- GGUF and permissions
def test_gguf_from_all_bf16_source_keeps_modulation_tables_f32(tmp_path):
    """A source like ComfyUI's krea2_*_bf16 (all BF16, D = 640 so the last table has more than 1024
    values); both layouts. ComfyUI-GGUF copies these tables raw into plain parameters."""
    from gguf import GGMLQuantizationType, GGUFReader

    config = {**tiny_transformer_config(), "attention_head_dim": 32, "num_attention_heads": 20, "num_key_value_heads": 4,
              "axes_dims_rope": (8, 12, 12), "num_layers": 1}
    model = Krea2Transformer2DModel(**config)
    for name, state in (("original", convert_diffusers_to_original(model.state_dict())), ("diffusers", model.state_dict())):
        src, out = tmp_path / f"{name}_bf16.safetensors", tmp_path / f"{name}.gguf"
        save_safetensors({k: v.to(torch.bfloat16) for k, v in state.items()}, src)
        assert main(["quantize", str(src), str(out), "--type", "Q8_0"]) == 0
        assert_readable_by_others(out)
        types = {t.name: (t.tensor_type, tuple(int(d) for d in t.shape)) for t in GGUFReader(out).tensors}
        assert types["last.modulation.lin"] == (GGMLQuantizationType.F32, (640, 2)), name
        assert types["blocks.0.mod.lin"][0] == GGMLQuantizationType.F32, name


def test_convert_and_lora_export_are_readable_by_others(original_file, tmp_path):
    from krea2_diffusers.loaders.lora import LoraLayer, lora_metadata, save_lora_file

    out = tmp_path / "diffusers_folder"
    assert main(["convert", str(original_file), str(out)]) == 0
    for path in [out, *out.rglob("*")]:
        assert stat.S_IMODE(os.stat(path).st_mode) == (0o755 if path.is_dir() else PUBLISHED_MODE), path
    back = tmp_path / "back.safetensors"
    assert main(["convert", str(out), str(back)]) == 0
    assert_readable_by_others(back)
    layers = {"transformer_blocks.0.attn.to_q": LoraLayer(torch.randn(4, 64), torch.randn(64, 4), 4.0)}
    for fmt in ("diffusers", "comfyui", "kohya"):
        path = save_lora_file(tmp_path / f"lora_{fmt}.safetensors", layers, fmt, lora_metadata(layers, fmt, "tiny-random"))
        assert_readable_by_others(path)


def _dcp_checkpoint(path, model_state: dict, train_state: dict):
    """A checkpoint folder as the trainer writes it: DCP shards of ``{"model": ...}`` plus its run state."""
    import json

    import torch.distributed.checkpoint as dcp

    from finetune.engine.checkpoint import STATE_FILE

    dcp.save({"model": model_state}, checkpoint_id=str(path), no_dist=True)
    (path / STATE_FILE).write_text(json.dumps({"step": 1, "base_model": "tiny-random", **train_state}))
    return path


def test_trainer_exports_are_readable_by_others(parts, tmp_path):
    from finetune.export.writer import export_checkpoint

    adapter = {"transformer_blocks.0.attn.to_q.lora_A.default.weight": torch.randn(32, 64),
               "transformer_blocks.0.attn.to_q.lora_B.default.weight": torch.randn(64, 32)}
    lora = _dcp_checkpoint(tmp_path / "lora-step-1", adapter,
                           {"method": "lora", "lora": {"alpha": 32, "rank": 32, "use_dora": False}})
    transformer = parts["transformer"]
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(transformer.config).items() if not k.startswith("_")}
    full = _dcp_checkpoint(tmp_path / "full-step-1", {k: v.contiguous() for k, v in transformer.state_dict().items()},
                           {"method": "full", "transformer_config": config})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = export_checkpoint(lora, tmp_path / "lora") + export_checkpoint(full, tmp_path / "full")
    # An export reads the checkpoint in this process on purpose: torch's "assuming the intent is to load in a
    # single process" warning is noise to the user (finetune.engine.checkpoint.load_in_this_process).
    assert not [str(w.message) for w in caught if "single process" in str(w.message)]
    files = [p for path in written for p in ([path] if path.is_file() else path.rglob("*"))]
    assert len(files) == 6
    for path in files:
        assert_readable_by_others(path)
