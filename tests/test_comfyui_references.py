"""Reference images (edit LoRAs): ComfyUI's NATIVE Krea 2 model and our pipeline, step by step.

The same random weights, prompt, reference, seed and sigmas run twice:

* ComfyUI (the session's real server): ``UNETLoader`` (our original-layout file) ->
  ``LoraLoaderModelOnly`` (a random LoRA written by our export writer), ``LoadImage`` -> native
  ``VAEEncode`` -> ``ReferenceLatent`` -> the Kontext reference-method node, ``RandomNoise``/``euler``.
  The text conditioning comes from our ``Krea2TextEncode`` node (the reference as vision tokens):
  ComfyUI's CLIPLoader builds only the 4B Qwen3-VL. Every step is its own ``SamplerCustomAdvanced``
  over two sigmas (Euler has no memory, so the chain is the N-step run), whose ``denoised_output``
  is that step's denoiser output.
* ours: ``Krea2Pipeline.from_single_file`` on the same files with the LoRA loaded, ``reference_images``.

Tolerance from the numerics: both are float32 evaluations of one function. Our pipeline in float64
gives the exact values; our float32 error against them sets the scale, ComfyUI's must be within
:data:`ROUNDING_FACTOR` times it (different op orders, merged vs separate LoRA matmuls).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from comfyui_harness import HARNESS, NO_HARNESS
from lora_checks import COMFY_TEXT_WIDTH, comfy_model_config, save_comfy_text_encoder

pytestmark = [pytest.mark.skipif(not HARNESS, reason=NO_HARNESS), pytest.mark.usefixtures("one_thread")]

MODEL, TE, VAE, LORA, REF = ("krea2_refs_tiny.safetensors", "qwen3vl_refs_tiny40", "refs_qwen_image_vae.safetensors",
                             "krea2_refs_lora.safetensors", "edit_reference.png")
# Not named qwen_image_vae*: the session's server is shared with test_comfyui_server, whose loader
# default (the first qwen_image_vae* file) must stay its own VAE whichever module runs first.
PROMPT, SEED, SIZE, STEPS = "make the shape red", 11, 64, 3
ROUNDING_FACTOR = 16


def _write_models(base) -> None:
    from diffusers import AutoencoderKLQwenImage
    from krea2_diffusers.loaders.lora import lora_layers_from_diffusers_state_dict, lora_metadata, save_lora_file
    from krea2_diffusers.loaders.vae import save_wan_vae
    from krea2_diffusers.models.tiny import randomize_, save_random_original_file
    from krea2_diffusers.models.transformer import Krea2Transformer2DModel

    models = base / "models"
    config = comfy_model_config(text_hidden_dim=COMFY_TEXT_WIDTH)
    save_random_original_file(models / "diffusion_models" / MODEL, config, seed=3)
    save_comfy_text_encoder(models / "text_encoders" / TE, seed=3)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)  # ComfyUI's VAE shape
    randomize_(vae, torch.Generator().manual_seed(3))
    save_wan_vae(vae, models / "vae" / VAE)
    # A random LoRA on every linear layer of the blocks, written as the trainer's export writes it.
    generator, rank = torch.Generator().manual_seed(4), 4
    state = {}
    for name, module in Krea2Transformer2DModel(**config).named_modules():
        if name.startswith("transformer_blocks.") and isinstance(module, torch.nn.Linear):
            state[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.1
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.1
    layers = lora_layers_from_diffusers_state_dict(state, alpha=rank, rank=rank)
    save_lora_file(models / "loras" / LORA, layers, "comfyui", lora_metadata(layers, "comfyui", MODEL))
    (base / "input").mkdir(exist_ok=True)
    pixels = np.random.default_rng(3).integers(0, 256, (48, 80, 3), dtype=np.uint8)  # 3 x 5 tokens: kept as it is
    Image.fromarray(pixels).save(base / "input" / REF)


def _native_graph(method: str, times: list[float]) -> dict:
    """ComfyUI's native workflow, one SamplerCustomAdvanced per step, each step's denoised latent saved."""
    graph = {
        "pipe": {"class_type": "Krea2ModelLoader", "inputs": {"model": MODEL, "variant": "raw", "text_encoder": TE, "vae": VAE,
                                                              "dtype": "float32", "memory": "high"}},
        "image": {"class_type": "LoadImage", "inputs": {"image": REF}},
        "refs": {"class_type": "Krea2ReferenceImage", "inputs": {"image": ["image", 0], "strength": 1.0}},
        "text": {"class_type": "Krea2TextEncode", "inputs": {"pipeline": ["pipe", 0], "prompt": PROMPT, "references": ["refs", 0]}},
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
        "lora": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["unet", 0], "lora_name": LORA, "strength_model": 1.0}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "encoded": {"class_type": "VAEEncode", "inputs": {"pixels": ["image", 0], "vae": ["vae", 0]}},
        "reference": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["text", 0], "latent": ["encoded", 0]}},
        "method": {"class_type": "FluxKontextMultiReferenceLatentMethod",
                   "inputs": {"conditioning": ["reference", 0], "reference_latents_method": method}},
        "guider": {"class_type": "BasicGuider", "inputs": {"model": ["lora", 0], "conditioning": ["method", 0]}},
        "euler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "empty": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "seed": {"class_type": "RandomNoise", "inputs": {"noise_seed": SEED}},
        "no_noise": {"class_type": "DisableNoise", "inputs": {}},
    }
    latent = ["empty", 0]
    for i in range(STEPS):
        graph[f"sigmas{i}"] = {"class_type": "ManualSigmas", "inputs": {"sigmas": f"{times[i]:.10f}, {times[i + 1]:.10f}"}}
        graph[f"step{i}"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["seed" if i == 0 else "no_noise", 0], "guider": ["guider", 0], "sampler": ["euler", 0],
            "sigmas": [f"sigmas{i}", 0], "latent_image": latent}}
        graph[f"save{i}"] = {"class_type": "SaveLatent", "inputs": {"samples": [f"step{i}", 1], "filename_prefix": f"refs_{method}_denoised{i}"}}
        latent = [f"step{i}", 0]
    graph["final"] = {"class_type": "SaveLatent", "inputs": {"samples": latent, "filename_prefix": f"refs_{method}_final"}}
    return graph


def _saved(server, entry, node_id) -> torch.Tensor:
    (found,) = entry["outputs"][node_id]["latents"]
    return load_file(str(server.base / "output" / found["subfolder"] / found["filename"]))["latent_tensor"].double()


def _ours(base, method: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor, list[float]]:
    """Our pipeline's denoised latent of every step and its final latents, both in ComfyUI's LATENT
    space (raw VAE latents, (1, 16, 1, h, w)), and the time grid."""
    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.latents import to_vae_space, unpack_latents

    models = base / "models"
    pipe = Krea2Pipeline.from_single_file(str(models / "diffusion_models" / MODEL), text_encoder=str(models / "text_encoders" / TE),
                                          vae=str(models / "vae" / VAE), torch_dtype=dtype, is_distilled=False)
    pipe.load_lora_weights(str(models / "loras" / LORA))
    pipe.set_progress_bar_config(disable=True)
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((args[0].double(), float(kwargs["timestep"][0]), out[0].double())),
        with_kwargs=True)
    latents = pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=0.0, output_type="latent",
                   generator=torch.Generator().manual_seed(SEED), reference_images=[base / "input" / REF],
                   reference_method=method).images
    hook.remove()
    space = lambda packed: to_vae_space(pipe.vae, unpack_latents(packed, SIZE, SIZE).to(dtype)).double()[:, :, None]
    denoised = [space(x - t * v) for x, t, v in calls]  # flow matching: x0 = x_t - t v
    return denoised, space(latents.double()), [t for _, t, _ in calls] + [0.0]


def test_native_comfyui_with_reference_and_lora_matches_the_pipeline_at_every_step(comfyui):
    """Both reference methods; they differ from each other by far more than the tolerance."""
    if not (comfyui.base / "models" / "loras" / LORA).exists():
        _write_models(comfyui.base)
    exact_by_method = {}
    for method in ("index_timestep_zero", "index"):
        exact, exact_final, times = _ours(comfyui.base, method, torch.float64)
        ours, ours_final, _ = _ours(comfyui.base, method, torch.float32)
        log_start = len(comfyui.output())
        entry = comfyui.run(_native_graph(method, times))
        assert "lora key not loaded" not in comfyui.output()[log_start:]
        native = [_saved(comfyui, entry, f"save{i}") for i in range(STEPS)] + [_saved(comfyui, entry, "final")]
        exact_by_method[method] = exact = exact + [exact_final]
        largest = 0.0
        for step, (e, o, n) in enumerate(zip(exact, ours + [ours_final], native)):
            rounding = (o - e).abs().max().item()
            error = (n.reshape(e.shape) - e).abs().max().item()
            print(f"{method} step {step}: |ours32 - exact| {rounding:.2e}, |native - exact| {error:.2e}, |exact| {e.abs().max():.2f}")
            assert 0 < rounding and error <= ROUNDING_FACTOR * rounding, (method, step, error, rounding)
            largest = max(largest, ROUNDING_FACTOR * rounding)
    apart = max((a - b).abs().max().item() for a, b in zip(*exact_by_method.values()))
    assert apart > 100 * largest, (apart, largest)  # the method node is not a no-op
