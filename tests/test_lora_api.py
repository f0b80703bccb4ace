"""diffusers' pipeline LoRA API on our pipelines (``loaders.lora_pipeline``): the same calls give the
same images as ``diffusers.Krea2Pipeline`` on the same weights, unfusing gives the base weights back
bit for bit, the per-call scale reaches cached references, and quantized bases refuse to fuse."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import save_file

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
from krea2_diffusers.loaders.adapters import LoraFuseError
from krea2_diffusers.loaders.lora import FORMATS, LoraLayer
from krea2_diffusers.models.tiny import randomize_, tiny_transformer_config

pytestmark = pytest.mark.usefixtures("one_thread")
H = W = 32
RUN = dict(height=H, width=W, num_inference_steps=2, guidance_scale=1.0, output_type="latent")


def transformer(seed: int = 0) -> Krea2Transformer2DModel:
    torch.manual_seed(seed)
    model = Krea2Transformer2DModel(**tiny_transformer_config())
    randomize_(model, torch.Generator().manual_seed(seed))
    return model.eval()


def pipelines(tiny_pipe):
    """Ours and diffusers' pipeline on one set of fresh transformer weights (the session's tiny encoders and VAE)."""
    import diffusers

    ours = transformer()
    theirs = diffusers.Krea2Transformer2DModel(**tiny_transformer_config())
    theirs.load_state_dict(ours.state_dict())
    shared = dict(scheduler=tiny_pipe.scheduler, vae=tiny_pipe.vae, tokenizer=tiny_pipe.tokenizer)
    pipes = (Krea2Pipeline(**shared, text_encoder=tiny_pipe.text_encoder, transformer=ours),
             diffusers.Krea2Pipeline(**shared, text_encoder=tiny_pipe.text_encoder.model, transformer=theirs.eval()))
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
    return pipes


def lora_file(path, model, seed: int, text_fusion: bool = True):
    """A random rank-4 LoRA on every block linear (and the text-fusion blocks'), as a diffusers/PEFT
    safetensors file; ``model`` has no adapters yet (PEFT's wrappers are not plain linear layers)."""
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name, module in model.named_modules():
        block = name.startswith("transformer_blocks.") or (text_fusion and name.startswith("text_fusion") and "_blocks." in name)
        if block and isinstance(module, torch.nn.Linear) and "base_layer" not in name and ".lora_" not in name:
            layers[name] = LoraLayer(torch.randn(4, module.in_features, generator=generator) * 0.2,
                                     torch.randn(module.out_features, 4, generator=generator) * 0.2)
    save_file(FORMATS["diffusers"](layers), str(path))
    return path


def generate(pipe, **kwargs):
    noise = torch.randn(1, (H // 16) * (W // 16), 64, generator=torch.Generator().manual_seed(0))
    return pipe("a red fox in the snow", latents=noise, **RUN, **kwargs).images


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def base_weights(model) -> dict[str, torch.Tensor]:
    """The base layers' tensors by their plain name (PEFT's ``base_layer`` hop removed)."""
    return {k.replace(".base_layer", ""): v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


def test_lora_calls_give_the_images_of_diffusers(tiny_pipe, tmp_path):
    ours, theirs = pipelines(tiny_pipe)
    style, brand = lora_file(tmp_path / "style.safetensors", ours.transformer, 1), lora_file(tmp_path / "brand.safetensors", ours.transformer, 2)
    before = base_weights(ours.transformer)
    plain = generate(ours)
    calls = [
        ("set_adapters", lambda p: p.set_adapters(["style", "brand"], adapter_weights=[0.8, 0.5])),
        ("fuse_lora", lambda p: p.fuse_lora(lora_scale=0.7)),
        ("unfuse_lora", lambda p: p.unfuse_lora()),
        ("disable_lora", lambda p: p.disable_lora()),
        ("enable_lora", lambda p: p.enable_lora()),
        ("delete_adapters", lambda p: p.delete_adapters("brand")),
    ]
    for pipe in (ours, theirs):
        pipe.load_lora_weights(str(style), adapter_name="style")
        pipe.load_lora_weights(str(brand), adapter_name="brand")
    images = {}
    for name, call in calls:
        call(ours), call(theirs)
        assert ours.get_active_adapters() == theirs.get_active_adapters(), name
        assert ours.get_list_adapters() == theirs.get_list_adapters(), name
        assert ours.fused_loras == theirs.fused_loras, name
        images[name] = generate(ours)
        assert rel_err(images[name], generate(theirs)) < 1e-4, name
        if name == "fuse_lora":
            fused = base_weights(ours.transformer)
            assert not torch.equal(fused["transformer_blocks.0.attn.to_q.weight"], before["transformer_blocks.0.attn.to_q.weight"])
        if name == "unfuse_lora":
            after = base_weights(ours.transformer)
            assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert ours.get_active_adapters() == ["style"] and ours.get_list_adapters() == {"transformer": ["style"]}
    # LoRAs off is the base model; unfused, the adapters act as fused (lora_scale stays on their weights,
    # as in diffusers); every other call changed the images
    assert rel_err(images["disable_lora"], plain) < 1e-6
    assert rel_err(images["unfuse_lora"], images["fuse_lora"]) < 1e-5
    steps = list(images.values())
    assert min(rel_err(a, b) for a, b in zip(steps, steps[1:]) if b is not images["unfuse_lora"]) > 1e-3


@pytest.mark.parametrize("attention", ["joint", "cached"])
def test_per_call_scale_reaches_the_reference_pass(tiny_pipe, tmp_path, attention):
    """``attention_kwargs={"scale": s}`` acts on every pass of a generation: the text fusion and the cached
    references' own pass too. Scale 0 is the LoRAs off; a scale composes with set_adapters' weights."""
    pipe = pipelines(tiny_pipe)[0]
    files = lora_file(tmp_path / "a.safetensors", pipe.transformer, 1), lora_file(tmp_path / "b.safetensors", pipe.transformer, 2, text_fusion=False)
    for name, path in zip("ab", files):
        pipe.load_lora_weights(path, adapter_name=name)
    picture = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (H, W, 3), dtype=np.uint8))
    run = lambda **kwargs: generate(pipe, reference_images=picture, reference_attention=attention, **kwargs)
    pipe.set_adapters(["a", "b"], [0.8, 0.5])
    lora = run()
    pipe.disable_lora()
    off = run()
    pipe.enable_lora()
    assert rel_err(lora, off) > 1e-2
    assert (run(attention_kwargs={"scale": 0.0}) - off).abs().max() <= 1e-6
    assert torch.equal(run(), lora)  # the weights survive a scale-0 call (diffusers resets them to 1.0)
    halved = run(attention_kwargs={"scale": 0.5})
    pipe.set_adapters(["a", "b"], [0.4, 0.25])
    assert (halved - run()).abs().max() <= 1e-6
    assert rel_err(halved, lora) > 1e-3


def test_fusing_into_a_quantized_base_is_refused_naming_the_layer(tiny_pipe, tmp_path):
    from krea2_diffusers.quantization.fp8 import quantize_transformer_fp8_

    pipe = pipelines(tiny_pipe)[0]
    quantize_transformer_fp8_(pipe.transformer, compute_dtype=torch.float32)
    pipe.load_lora_weights(lora_file(tmp_path / "a.safetensors", pipe.transformer, 1), adapter_name="a")
    pipe.set_adapters("a", 0.8)
    lora = generate(pipe)
    before = base_weights(pipe.transformer)
    with pytest.raises(LoraFuseError, match=r"cannot merge into '[\w.]+': its base layer is Fp8Linear \(torch\.uint8 weights\)"):
        pipe.fuse_lora(lora_scale=0.5)
    after = base_weights(pipe.transformer)  # nothing changed: not the float text-fusion layers before it either
    assert all(torch.equal(after[k], before[k]) for k in before) and not pipe.fused_loras
    assert torch.equal(generate(pipe), lora)
