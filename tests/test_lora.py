"""LoRA files: every format we export or users bring loads with the same effect, and bad files
fail naming the key at fault."""

import pytest
import torch
from safetensors.torch import save_file

from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.latents import position_ids
from krea2_diffusers.loaders.lora import (FORMATS, LoraFormatError, LoraLayer, apply_lora_layers, detect_format, load_lora_into_transformer,
                                  lora_layers_from_peft, lora_metadata, read_lora_file, save_lora_file, set_lora_strength)
from krea2_diffusers.models.tiny import tiny_transformer_config


@pytest.fixture(scope="module")
def base_state():
    torch.manual_seed(0)
    model = Krea2Transformer2DModel(**tiny_transformer_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:
                p.normal_(0, 0.1)
    return model.state_dict()


def _model(base_state):
    model = Krea2Transformer2DModel(**tiny_transformer_config())
    model.load_state_dict(base_state)
    return model.eval()


INPUTS = dict(
    hidden_states=torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)),
    encoder_hidden_states=torch.randn(2, 5, 12, 32, generator=torch.Generator().manual_seed(2)),
    timestep=torch.tensor([0.3, 0.8]),
    position_ids=position_ids(5, 4, 4),
    encoder_attention_mask=torch.tensor([[True] * 5, [True] * 3 + [False] * 2]),
)


def _run(model):
    with torch.no_grad():
        return model(**INPUTS).sample


def _layers(model, rank=4, alpha=8.0, text_fusion=True):
    """Random adapters on every block linear (and the text-fusion blocks, whose kohya names hold
    underscores that are not dots: txtfusion_layerwise_blocks_0_...)."""
    g = torch.Generator().manual_seed(3)
    layers = {}
    for name, module in model.named_modules():
        block = name.startswith("transformer_blocks.") or (text_fusion and "_blocks." in name and name.startswith("text_fusion"))
        if block and isinstance(module, torch.nn.Linear) and "base_layer" not in name and ".lora_" not in name:
            layers[name] = LoraLayer(torch.randn(rank, module.in_features, generator=g) * 0.2,
                                     torch.randn(module.out_features, rank, generator=g) * 0.2, alpha)
    return layers


@pytest.mark.parametrize("fmt", ["diffusers", "comfyui", "kohya", "ai-toolkit"])
def test_every_format_has_the_same_effect(base_state, tmp_path, fmt):
    model = _model(base_state)
    base = _run(model)
    layers = _layers(model)
    reference = _model(base_state)
    load_lora_into_transformer(reference, FORMATS["diffusers"](layers), strength=0.7)
    expected = _run(reference)
    assert (expected - base).abs().max() > 1e-2  # the LoRA does something
    if fmt == "ai-toolkit":
        tensors = {"base_model.model." + k.removeprefix("diffusion_model."): v for k, v in FORMATS["comfyui"](layers).items()}
    else:
        tensors = FORMATS[fmt](layers)
    path = tmp_path / f"{fmt}.safetensors"
    save_file(tensors, str(path))
    assert detect_format(tensors) == {"diffusers": "diffusers", "comfyui": "native", "kohya": "kohya", "ai-toolkit": "native"}[fmt]
    name = load_lora_into_transformer(model, path, strength=0.7)
    torch.testing.assert_close(_run(model), expected, rtol=1e-5, atol=1e-6)
    set_lora_strength(model, name, 0.0)
    torch.testing.assert_close(_run(model), base, rtol=1e-5, atol=1e-6)


def test_kohya_names_keep_underscored_module_names_and_alpha(base_state):
    model = _model(base_state)
    layers = _layers(model, rank=4, alpha=2.0)
    kohya = FORMATS["kohya"](layers)
    assert "lora_unet_txtfusion_layerwise_blocks_0_attn_wq.lora_down.weight" in kohya
    assert "lora_unet_blocks_1_mlp_down.lora_up.weight" in kohya
    # A kohya file that keeps the raw weights and states alpha separately (as musubi-tuner writes
    # it) must act like the folded export.
    raw = {}
    for module, layer in layers.items():
        key = next(k for k in kohya if k.endswith(".lora_down.weight") and torch.equal(kohya[k], layer.down)).removesuffix(".lora_down.weight")
        raw[f"{key}.lora_down.weight"], raw[f"{key}.lora_up.weight"], raw[f"{key}.alpha"] = layer.down, layer.up, torch.tensor(2.0)
    other = _model(base_state)
    load_lora_into_transformer(model, kohya)
    load_lora_into_transformer(other, raw)
    torch.testing.assert_close(_run(model), _run(other))


def test_two_loras_stack_with_their_own_strengths(base_state):
    model = _model(base_state)
    first = load_lora_into_transformer(model, FORMATS["diffusers"](_layers(model)), strength=1.0)
    second = load_lora_into_transformer(model, FORMATS["comfyui"](_layers(_model(base_state), alpha=4.0)), strength=0.5)
    assert (first, second) == ("lora_0", "lora_1")
    both = _run(model)
    set_lora_strength(model, second, 0.0)
    assert (_run(model) - both).abs().max() > 1e-3


def test_bad_files_fail_naming_the_key(base_state, tmp_path):
    model = _model(base_state)
    layers = _layers(model, text_fusion=False)
    good = FORMATS["diffusers"](layers)
    with pytest.raises(LoraFormatError, match=r"'transformer.transformer_blocks.9.attn.to_q.lora_A.weight' names no linear layer.*closest"):
        load_lora_into_transformer(model, {**good, "transformer.transformer_blocks.9.attn.to_q.lora_A.weight": torch.zeros(4, 64)})
    with pytest.raises(LoraFormatError, match=r"unrecognised LoRA key 'lora_unet_blocks_0_attn_wq.oft_blocks'"):
        load_lora_into_transformer(model, {"lora_unet_blocks_0_attn_wq.oft_blocks": torch.zeros(2, 2)})
    bad = dict(good)
    bad["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"] = torch.zeros(4, 63)
    with pytest.raises(LoraFormatError, match=r"'transformer_blocks.0.attn.to_q': down \(4, 63\).*do not fit a 64->64"):
        load_lora_into_transformer(model, bad)
    bad = dict(good)
    bad["transformer.transformer_blocks.0.ff.up.lora_B.weight"] = torch.full((128, 4), float("nan"))
    with pytest.raises(LoraFormatError, match=r"'transformer_blocks.0.ff.up': the B tensor holds NaN"):
        load_lora_into_transformer(model, bad)
    bad = {k: v for k, v in good.items() if k != "transformer.transformer_blocks.1.ff.down.lora_B.weight"}
    with pytest.raises(LoraFormatError, match=r"'transformer_blocks.1.ff.down' lacks its up/lora_B"):
        load_lora_into_transformer(model, bad)
    pickled = tmp_path / "lora.bin"
    torch.save(good, pickled)
    with pytest.raises(LoraFormatError, match="only .safetensors"):
        load_lora_into_transformer(model, pickled)
    # What a process without the gathered adapter would hold (issue 22): refused, never an empty adapter.
    with pytest.raises(LoraFormatError, match="no LoRA layers to apply as adapter 'validation'"):
        apply_lora_layers(model, {}, adapter_name="validation")
    assert not getattr(model, "peft_config", None)  # nothing half-applied


def test_export_metadata_and_refusal_of_untrained_lora(base_state, tmp_path):
    model = _model(base_state)
    layers = _layers(model, rank=4, alpha=8.0)
    meta = lora_metadata(layers, "kohya", "krea/Krea-2-Raw", trained_alpha=8.0, trigger_words=["acme"], steps=12)
    path = save_lora_file(tmp_path / "k.safetensors", layers, "kohya", meta)
    tensors, read_meta = read_lora_file(path)
    assert read_meta["krea2.base_model"] == "krea/Krea-2-Raw" and read_meta["krea2.rank"] == "4"
    assert read_meta["krea2.trained_alpha"] == "8.0" and read_meta["krea2.steps"] == "12"
    assert read_meta["modelspec.trigger_phrase"] == "acme" and read_meta["ss_network_dim"] == "4"
    assert float(tensors["lora_unet_blocks_0_attn_wq.alpha"]) == 4.0  # scale folded into lora_up
    zero = {m: LoraLayer(l.down, torch.zeros_like(l.up)) for m, l in layers.items()}
    with pytest.raises(ValueError, match="would do nothing"):
        save_lora_file(tmp_path / "z.safetensors", zero, "diffusers", meta)


def test_trained_peft_adapter_round_trips(base_state):
    from peft import LoraConfig

    model = _model(base_state)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "ff.down"], init_lora_weights=False))
    trained = _run(model)
    layers = lora_layers_from_peft(model)
    fresh = _model(base_state)
    load_lora_into_transformer(fresh, FORMATS["kohya"](layers))
    torch.testing.assert_close(_run(fresh), trained, rtol=1e-5, atol=1e-6)


def test_diffusers_format_loads_into_diffusers_transformer(base_state, tmp_path):
    """The diffusers-format file is read by diffusers' own Krea 2 model and loader, with the same effect."""
    import diffusers

    ours = _model(base_state)
    layers = _layers(ours, text_fusion=False)
    path = save_lora_file(tmp_path / "lora_diffusers.safetensors", layers, "diffusers", lora_metadata(layers, "diffusers", "x"))
    load_lora_into_transformer(ours, path)
    theirs = diffusers.Krea2Transformer2DModel(**tiny_transformer_config())
    theirs.load_state_dict(base_state)
    theirs.eval()
    reference = _run(theirs)
    state = diffusers.Krea2Pipeline.lora_state_dict(str(path))
    theirs.load_lora_adapter(state, prefix="transformer", adapter_name="ours")
    out = _run(theirs)
    assert (out - reference).abs().max() > 1e-2
    torch.testing.assert_close(out, _run(ours), rtol=1e-4, atol=1e-5)
